"""`launcher dv`: see DataVolumes' phases, run a standalone import, issue upload tokens."""

from __future__ import annotations

import json

import click

from diskkit.cli.shell import registry_options
from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions
from launcher.cli.options import cache_option, node_cache, say, storage_options, trust_options


def _known(store, vmi_files: tuple[str, ...]):
    """DataVolumes of the manifests and of the given VMs' dataVolumeTemplates."""
    from launcher.datavolumes.control import manifests
    from launcher.spec.vmi import load_vmi

    found = dict(manifests(store))
    for path in vmi_files:
        vmi = load_vmi(path, ignore_unsupported=True, objects=store.objects)  # only its dataVolumeTemplates are read here
        found.update({(dv.namespace, dv.name): dv for dv in vmi.data_volume_templates})
    return found


def _one(store, vmi_files, name: str, namespace: str):
    from launcher.datavolumes.control import find

    namespace, _, plain = name.rpartition("/") if "/" in name else (namespace, "", name)
    extra = tuple(_known(store, vmi_files).values()) if vmi_files else ()
    return find(store, plain, namespace, extra)


def _describe(dv, store) -> dict:
    from launcher.datavolumes import dvstate

    try:
        return dvstate.describe(dvstate.resolve(dv, store))
    except DiskkitError as exc:
        return {"name": dv.name, "namespace": dv.namespace, "source": dv.source.kind, "phase": "Unknown",
                "progress": "N/A", "message": exc.line(), "origin": dv.origin}


vmi_option = click.option("--vmi", "vmi_files", multiple=True, type=click.Path(dir_okay=False, exists=True), metavar="FILE",
                          help="Also the dataVolumeTemplates of this VM/VMI (repeatable).")
namespace_option = click.option("-n", "--namespace", default="default", show_default=True, help="Namespace of NAME (or give NAMESPACE/NAME).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def dv() -> None:
    """DataVolumes (cdi.kubevirt.io/v1beta1): phases, imports, upload tokens.

    DataVolumes come from --manifests and from VMs' dataVolumeTemplates (--vmi). Each fills the
    claim of its name; its phase and progress live in datavolume.json beside the claim's disk.img.
    """


@dv.command("ls", epilog="""\b
Examples:
  launcher dv ls --manifests ./k8s --pvc fedora=/srv/claims/fedora
  launcher dv ls --vmi vm.yaml --pvc root=/srv/claims/root --json
""")
@vmi_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@storage_options
def ls(vmi_files, as_json, store) -> None:
    """List DataVolumes with their phase and progress."""
    rows = [_describe(dv, store) for dv in _known(store, vmi_files).values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'NAMESPACE/NAME':32} {'SOURCE':9} {'PHASE':22} {'PROGRESS':9} CLAIM")
    for row in rows:
        claim = row.get("claim") or row.get("message") or "-"
        click.echo(f"{row['namespace'] + '/' + row['name']:32} {row['source']:9} {row['phase']:22} {row['progress']:9} {claim}")


@dv.command("status", epilog="""\b
Examples:
  launcher dv status fedora --manifests ./k8s --pvc fedora=/srv/claims/fedora
  launcher dv status default/root --vmi vm.yaml --json | jq -r .phase
""")
@click.argument("name")
@namespace_option
@vmi_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@storage_options
def status(name, namespace, vmi_files, as_json, store) -> None:
    """Show one DataVolume: phase, progress, message, claim."""
    row = _describe(_one(store, vmi_files, name, namespace), store)
    if as_json:
        click.echo(json.dumps(row, indent=2))
        return
    for key in ("namespace", "name", "source", "phase", "progress", "message", "consumer", "storageClass", "claim", "disk"):
        if row.get(key) is not None:
            click.echo(f"{key + ':':14}{row[key]}")


@dv.command("import", epilog="""\b
Examples:
  launcher dv import fedora --manifests ./k8s --pvc fedora=/srv/claims/fedora:20Gi
  launcher dv import disks/fedora --manifests ./k8s --tls-verify=false --json
""")
@click.argument("name")
@namespace_option
@vmi_option
@click.option("--json", "as_json", is_flag=True, help="Print the final status as one JSON object.")
@storage_options
@registry_options
@trust_options
def import_cmd(name, namespace, vmi_files, as_json, store, registry: RegistryOptions) -> None:
    """Run a DataVolume's import (http, registry, blank or pvc clone) into its claim, now.

    The image is fetched into the claim directory, checked (raw, qcow2, vmdk, vdi, vpc or vhdx, no
    backing file, fits the claim), converted to a sparse raw disk.img and renamed into place; with
    contentType: archive the tar's files are unpacked into the claim instead. A failed import leaves
    the claim as it was. Under a WaitForFirstConsumer storage class the
    import waits for a VM to use the claim first.
    """
    from launcher.datavolumes import dvstate
    from launcher.datavolumes.control import fill_now
    from launcher.spec import datavolume as dvm

    datavolume = _one(store, vmi_files, name, namespace)
    target = dvstate.resolve(datavolume, store)
    phase = dvstate.current_phase(target)
    where = f"DataVolume {datavolume.key}"
    if datavolume.source.kind == "upload":
        raise DiskkitError(where, f"is an upload DataVolume: send the disk with diskkit upload {datavolume.key} FILE")
    if phase == dvm.WAIT_FOR_FIRST_CONSUMER:
        raise DiskkitError(where, f"in state {phase}: storage class {target.storage_class} binds claim {datavolume.name}"
                                  " when a VM using it starts (launcher run); import it after that")
    if phase == dvm.SUCCEEDED:
        say(f"{where}: already Succeeded")
    while dvstate.current_phase(target) != dvm.SUCCEEDED and not fill_now(target, store, registry, say):
        say(f"{where}: another importer is at work; waiting for it")
        with dvstate.work_lock(target, wait=True):
            pass  # it finished (or died): look again
    row = dvstate.describe(target)
    click.echo(json.dumps(row, indent=2) if as_json else row["disk"] or row["claim"])  # an archive fills the claim itself


@dv.command("token", epilog="""\b
Examples:
  launcher dv token fedora
  diskkit upload fedora fedora.qcow2 --url http://node:8443 --token "$(launcher dv token fedora)"
""")
@click.argument("name")
@namespace_option
@click.option("--ttl", type=click.FloatRange(min=1), default=3600, show_default=True, metavar="SECONDS", help="How long the token is valid.")
@click.option("--json", "as_json", is_flag=True, help='Print {"namespace": ..., "name": ..., "token": ...}.')
@cache_option
def token(name, namespace, ttl, as_json, cache_dir) -> None:
    """Print an upload token for DataVolume NAME, signed with this node's key (as an UploadTokenRequest)."""
    from launcher.datavolumes.uploadserver import issue_token, node_key

    namespace, _, plain = name.rpartition("/") if "/" in name else (namespace, "", name)
    issued = issue_token(node_key(node_cache(cache_dir).root), namespace, plain, ttl)
    click.echo(json.dumps({"namespace": namespace, "name": plain, "token": issued, "ttlSeconds": ttl}, indent=2) if as_json else issued)


def start_uploads(listen: str, tls_cert: str | None, tls_key: str | None, vmi_files: tuple[str, ...], cache_dir, store):
    """The upload side of `launcher serve`, serving from a thread of its own."""
    from launcher.datavolumes.uploadserver import UploadServer, node_key

    if (tls_cert is None) != (tls_key is None):
        raise DiskkitError("--upload-tls-cert", "needs --upload-tls-key, and the other way round")
    server = UploadServer(listen, store, list(_known(store, vmi_files).values()), node_key(node_cache(cache_dir).root), say,
                          (tls_cert, tls_key) if tls_cert else None)
    if not server.uploads:
        say("note: no upload DataVolume in --manifests or --vmi; every upload will be refused")
    server.start()
    say(f"serving uploads on {server.url}")
    return server

