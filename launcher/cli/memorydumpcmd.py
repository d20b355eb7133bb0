"""`launcher memory-dump get|remove`: a running VM's memory dumped into a claim, as `virtctl
memory-dump get|remove` (pkg/virtctl/memorydump/memorydump.go) have KubeVirt dump it."""

from __future__ import annotations

import json

import click

from launcher.cli.options import cache_option, node_cache, say, storage_options


@click.group("memory-dump")
def memory_dump() -> None:
    """Dump the memory of a running VM into a claim (virtctl memory-dump)."""


@memory_dump.command("get", epilog="""\b
Examples:
  launcher memory-dump get myvm --claim-name memoryvolume --pvc memoryvolume=/srv/claims/memoryvolume
  launcher memory-dump get myvm --claim-name memoryvolume --create-claim --pvc memoryvolume=/srv/claims/new
  launcher memory-dump get myvm --pvc memoryvolume=/srv/claims/memoryvolume   # again, into the associated claim
""")
@click.argument("name")
@click.option("--claim-name", help="The claim to hold the dump; it stays associated with the VM until `memory-dump remove`.")
@click.option("--create-claim", is_flag=True, help="Make the claim's directory (refused when it exists), as virtctl creates the PVC.")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "claimName", "path", "size", "createdClaim"}.')
@cache_option
@storage_options
def get(name, claim_name, create_claim, as_json, cache_dir, store) -> None:
    """Dump the memory of the running VM NAME (NAME, NAMESPACE/NAME or domain name) into a claim:
    libvirt writes the guest's memory as an ELF core (virDomainCoreDumpWithFormat, memory only, as
    virt-launcher asks it) named `<vmi>-<claim>-<YYYYMMDD-HHMMSS>.memory.dump`, after removing the
    earlier dumps in the claim, and the path of the dump in the claim is printed.

    The claim is found as `launcher run` finds one (--pvc CLAIM=DIR[:SIZE], or --manifests with a claim
    bound to a hostPath/local PV) and must hold the VM's memory and 100 MiB, plus 5.5 % (KubeVirt's
    rule; the free space of its directory when no size is given). Refused, as virt-api refuses it,
    when the VM is not running, with no claim named or associated, or with another claim associated.
    """
    from launcher.runtime.memorydump import get as dump

    done = dump(node_cache(cache_dir), store, name, claim_name, create_claim, say)
    if as_json:
        click.echo(json.dumps({"name": name, "claimName": done.claim, "path": str(done.path), "size": done.size,
                               "createdClaim": done.created_claim}, indent=2))
    else:
        say(f"memory dump of VM {name} into claim {done.claim}: Completed ({done.size} bytes)")
        click.echo(done.path)


@memory_dump.command("remove", epilog="""\b
Examples:
  launcher memory-dump remove myvm
""")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "claimName", "message"}.')
@cache_option
def remove(name, as_json, cache_dir) -> None:
    """Dissociate the VM's memory dump claim, so that the next dump may go to another claim; the dumps
    stay in the claim."""
    from launcher.runtime.memorydump import remove as dissociate

    claim = dissociate(node_cache(cache_dir), name)
    message = f"Successfully submitted remove memory dump association of VM {name}"  # virtctl's words
    click.echo(json.dumps({"name": name, "claimName": claim, "message": message}, indent=2) if as_json else message)
