"""`launcher run`'s VMI_FILE may name a KubeVirt VM export instead (oci-archive:, oci:, docker://):
its VirtualMachine is run with each claim its volumes name taken from the export's disks. The
export is data: its own VirtualMachine may use nothing but those disks, unless `--spec FILE` gives
a VM or VMI of the user's own to run them under."""

from __future__ import annotations

import os

import click

from diskkit.errors import DiskkitError
from launcher.spec.meta import STDIN

TRANSPORTS = ("docker://", "oci:", "oci-archive:")


def spec_option(command):
    return click.option("--spec", "own_spec", type=click.Path(dir_okay=False, exists=True), metavar="FILE",
                        help="With an EXPORT: run its claims under this VM or VMI file of your own (its persistentVolumeClaim"
                             " volumes name the export's claims) instead of the export's VirtualMachine, which may use only"
                             " the export's own disks.")(command)


def is_export(arg: str) -> bool:
    """VMI_FILE names a VM export, not a file."""
    return arg != STDIN and not os.path.exists(arg) and arg.startswith(TRANSPORTS)


def vm_file(arg: str, cache_dir, store, registry, platform, own_spec: str | None = None) -> str:
    """The file to load: `arg` itself (`-`: stdin), or an export's VM with its claims put in `store`
    (`own_spec` in its place when given)."""
    if not is_export(arg):
        if arg == STDIN:
            return arg
        if own_spec is not None:
            raise click.BadParameter("is for an EXPORT (oci-archive:FILE, oci:DIR or docker://REF): give your own file as VMI_FILE",
                                     param_hint="--spec")
        if not os.path.isfile(arg):
            raise click.BadParameter(f"{arg!r}: no such file (or give - for stdin, or oci-archive:FILE, oci:DIR or docker://REF of a VM export)",
                                     param_hint="VMI_FILE")
        return arg
    from launcher.cli.options import node_cache
    from launcher.node.vmexport import materialize
    from launcher.volumes.storage import LocalClaim

    done = materialize(node_cache(cache_dir), arg, registry, platform, own_spec=own_spec is not None)
    for claim, path in done.claims.items():
        if claim in store.pvcs:
            raise DiskkitError(f"--pvc {claim}", f"claim {claim!r} is a disk of the export {arg}")
        store.pvcs[claim] = LocalClaim(path)
    return own_spec if own_spec is not None else str(done.vm_file)
