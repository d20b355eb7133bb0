"""`diskkit export`: a VirtualMachine and its claims' disks as a KubeVirt VM export (OCI)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from diskkit.cli.shell import registry_options
from diskkit.errors import DiskkitError
from diskkit.progress import reporter_for
from diskkit.registry.options import RegistryOptions


def _pairs(values: tuple[str, ...], kind: str, into: dict) -> None:
    for value in values:
        claim, sep, path = value.partition("=")
        if not sep or not claim or not path:
            raise DiskkitError(f"--{kind} {value}", f"must be CLAIM={'DIR' if kind == 'pvc' else 'FILE'}")
        if claim in into:
            raise DiskkitError(f"--{kind} {value}", f"claim {claim!r} is given twice")
        into[claim] = (Path(path), kind)


@click.command("export", epilog="""\b
Examples:
  diskkit export vm.yaml --pvc rootdisk=/srv/claims/rootdisk -t oci-archive:vm.oci.tar
  diskkit export vm.yaml --disk rootdisk=root.img --disk data=data.img -t quay.io/me/vms/web:1
  diskkit export vm.yaml --pvc rootdisk=/srv/claims/rootdisk -t oci:./vm-layout --json
  launcher run oci-archive:vm.oci.tar --console                  # runs it again
""")
@click.argument("vm_file", type=click.Path(dir_okay=False, exists=True))
@click.option("--pvc", multiple=True, metavar="CLAIM=DIR", help="A claim's directory: its disk.img is the claim's disk (as KubeVirt exports a filesystem claim). Repeatable.")
@click.option("--disk", multiple=True, metavar="CLAIM=FILE", help="A claim's disk as a file. Repeatable.")
@click.option("-t", "--dest", required=True, metavar="DEST", help="docker://REF (or REF), oci:DIR[:TAG] or oci-archive:FILE[:TAG].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the manifest and index digests and each disk's layer.")
@registry_options
def export_cmd(vm_file, pvc, disk, dest, as_json, registry: RegistryOptions) -> None:
    """Write VM_FILE (a VirtualMachine) and the disks of the claims its volumes use as KubeVirt's OCI
    VM export, the layout `virtctl vmexport download --format=oci` saves.

    The config is the VM as KubeVirt exports it (no namespace, no dataVolumeTemplates, dataVolume
    volumes as the claims of their names); each claim's disk is one zstd layer named by the claim
    (dots as dashes), read once: hashed, compressed and written in one pass. Every claim a volume
    names needs a --pvc or --disk. Prints the manifest digest.
    """
    from diskkit.ops.vmexport import export

    disks: dict = {}
    _pairs(pvc, "pvc", disks)
    _pairs(disk, "disk", disks)
    result = export(Path(vm_file), disks, dest, registry, reporter_for(as_json))
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else result.digest)
