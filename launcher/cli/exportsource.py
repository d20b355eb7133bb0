"""`launcher run`'s VMI_FILE may name a KubeVirt VM export instead (oci-archive:, oci:, docker://):
its VirtualMachine is run with each claim its volumes name taken from the export's disks."""

from __future__ import annotations

import os

import click

from diskkit.errors import DiskkitError
from launcher.spec.meta import STDIN

TRANSPORTS = ("docker://", "oci:", "oci-archive:")


def vm_file(arg: str, cache_dir, store, registry, platform) -> str:
    """The file to load: `arg` itself (`-`: stdin), or an export's VM with its claims put in `store`."""
    if arg == STDIN:
        return arg
    if os.path.exists(arg) or not arg.startswith(TRANSPORTS):
        if not os.path.isfile(arg):
            raise click.BadParameter(f"{arg!r}: no such file (or give - for stdin, or oci-archive:FILE, oci:DIR or docker://REF of a VM export)",
                                     param_hint="VMI_FILE")
        return arg
    from launcher.cli.options import node_cache
    from launcher.node.vmexport import materialize
    from launcher.volumes.storage import LocalClaim

    done = materialize(node_cache(cache_dir), arg, registry, platform)
    for claim, path in done.claims.items():
        if claim in store.pvcs:
            raise DiskkitError(f"--pvc {claim}", f"claim {claim!r} is a disk of the export {arg}")
        store.pvcs[claim] = LocalClaim(path)
    return str(done.vm_file)
