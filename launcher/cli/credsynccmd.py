"""`launcher sync-credentials`: the helper `launcher run` starts for a VM with qemuGuestAgent access
credentials (launcher.runtime.credsync); virt-launcher's access credential manager, as a process."""

from __future__ import annotations

from pathlib import Path

import click

from diskkit.errors import NotFound
from launcher.cli.options import cache_option, node_cache


@click.command("sync-credentials", epilog="""\b
Examples (launcher run starts it; launcher status shows what it did):
  launcher sync-credentials --manifests ./k8s default_testvm
  launcher status testvm        # AccessCredentialsSynchronized: True
""")
@click.argument("domain")
@click.option("--manifests", type=click.Path(file_okay=False, exists=True), help="Read the Secrets from this directory of manifests (what `launcher run --manifests` was given).")
@click.option("--kube-api", is_flag=True, help="Read the Secrets from the Kubernetes API.")
@cache_option
def sync_credentials(domain, manifests, kube_api, cache_dir) -> None:
    """Keep the ssh keys of a running VM's qemuGuestAgent access credentials in its guest, as
    KubeVirt's virt-launcher does: written through the guest agent at once, again when a Secret
    changes (looked at every 15 s) and every 5 minutes, retried while the agent is offline, until the
    VM stops. Neither flag: the Secrets where a launcher pod mounts them
    (/var/run/kubevirt-private/secret/NAME-access-cred).
    """
    from launcher.runtime.credsync import serve
    from launcher.runtime.lookup import connect

    cache = node_cache(cache_dir)
    record = cache.read_json(cache.vm_record_path(domain))
    if record is None:
        raise NotFound(domain, "no VM of this domain name was started from this cache")
    lv = connect(record)
    try:
        serve(lv, cache, domain, Path(manifests).resolve() if manifests else None, kube_api)
    finally:
        lv.close()
