"""`launcher memory-dump get|download|remove`: a running VM's memory dumped into a claim, and the last
dump fetched, as `virtctl memory-dump get|download|remove` (pkg/virtctl/memorydump/memorydump.go) have
KubeVirt do it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from launcher.cli.options import cache_option, node_cache, say, storage_options


@click.group("memory-dump")
def memory_dump() -> None:
    """Dump the memory of a running VM into a claim, download the last dump (virtctl memory-dump)."""


def download_options(f):
    f = click.option("--format", "fmt", type=click.Choice(["gzip", "raw"]), default="gzip", show_default=True,
                     help="gzip: the archive gzipped, as virtctl's default; raw: the tar itself.")(f)
    return click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
                        help="Where the download goes: a tar holding the dump, written whole or not at all"
                             " (replacing what is there, never through a link).")(f)


@memory_dump.command("get", epilog="""\b
Examples:
  launcher memory-dump get myvm --claim-name memoryvolume --pvc memoryvolume=/srv/claims/memoryvolume
  launcher memory-dump get myvm --claim-name memoryvolume --create-claim --pvc memoryvolume=/srv/claims/new
  launcher memory-dump get myvm --pvc memoryvolume=/srv/claims/memoryvolume   # again, into the associated claim
  launcher memory-dump get myvm --claim-name memoryvolume --create-claim --pvc memoryvolume=/srv/claims/new --output memoryDump.dump.gz
""")
@click.argument("name")
@click.option("--claim-name", help="The claim to hold the dump; it stays associated with the VM until `memory-dump remove`.")
@click.option("--create-claim", is_flag=True, help="Make the claim's directory (refused when it exists), as virtctl creates the PVC.")
@download_options
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "claimName", "path", "size", "createdClaim"}, and "output" with --output.')
@cache_option
@storage_options
def get(name, claim_name, create_claim, output, fmt, as_json, cache_dir, store) -> None:
    """Dump the memory of the running VM NAME (NAME, NAMESPACE/NAME or domain name) into a claim:
    libvirt writes the guest's memory as an ELF core (virDomainCoreDumpWithFormat, memory only, as
    virt-launcher asks it) named `<vmi>-<claim>-<YYYYMMDD-HHMMSS>.memory.dump`, after removing the
    earlier dumps in the claim, and the path of the dump in the claim is printed.

    The claim is found as `launcher run` finds one (--pvc CLAIM=DIR[:SIZE], or --manifests with a claim
    bound to a hostPath/local PV) and must hold the VM's memory and 100 MiB, plus 5.5 % (KubeVirt's
    rule; the free space of its directory when no size is given). Refused, as virt-api refuses it,
    when the VM is not running, with no claim named or associated, or with another claim associated.
    With --output the dump is then downloaded, as `memory-dump download` does.
    """
    from launcher.runtime.memorydump import download, get as dump

    cache = node_cache(cache_dir)
    done = dump(cache, store, name, claim_name, create_claim, say)
    fetched = download(cache, name, output, fmt, say) if output else None
    if as_json:
        answer = {"name": name, "claimName": done.claim, "path": str(done.path), "size": done.size, "createdClaim": done.created_claim}
        if fetched is not None:
            answer["output"] = str(fetched.output)
        click.echo(json.dumps(answer, indent=2))
    else:
        say(f"memory dump of VM {name} into claim {done.claim}: Completed ({done.size} bytes)")
        click.echo(done.path)


@memory_dump.command("download", epilog="""\b
Examples:
  launcher memory-dump download myvm --output memoryDump.dump.gz
  launcher memory-dump download myvm --output memoryDump.tar --format raw
""")
@click.argument("name")
@download_options
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "claimName", "fileName", "output", "format", "size"}.')
@cache_option
def download(name, output, fmt, as_json, cache_dir) -> None:
    """Download the last memory dump of the VM NAME, running or stopped since, as `virtctl memory-dump
    download` does: virtctl exports the dump's claim and fetches its archive, a tar of the claim's
    files gzipped (`--format raw`: the tar). Here the tar holds the dump, `./<vmi>-<claim>-<time>.memory.dump`
    (`tar -xzf FILE` gives it back), read from the claim where `memory-dump get` put it, and refused
    when the file there is no longer that dump.

    The output is written under a temporary name, synced and renamed over FILE: a link planted at
    FILE is replaced, never followed; as root, a link on the way to its directory is followed only
    where no other user could have put it. In another user's directory the file becomes theirs,
    mode 0600.
    """
    from launcher.runtime.memorydump import download as fetch

    done = fetch(node_cache(cache_dir), name, output, fmt, say)
    if as_json:
        click.echo(json.dumps({"name": name, "claimName": done.claim, "fileName": done.file_name, "output": str(done.output),
                               "format": fmt, "size": done.size}, indent=2))
    else:
        click.echo(done.output)


@memory_dump.command("remove", epilog="""\b
Examples:
  launcher memory-dump remove myvm
""")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "claimName", "message"}.')
@cache_option
def remove(name, as_json, cache_dir) -> None:
    """Dissociate the VM's memory dump claim, so that the next dump may go to another claim; the dumps
    stay in the claim. The association outlives the VM's runs, as a VirtualMachine's
    status.memoryDumpRequest does, until this."""
    from launcher.runtime.memorydump import remove as dissociate

    claim = dissociate(node_cache(cache_dir), name)
    message = f"Successfully submitted remove memory dump association of VM {name}"  # virtctl's words
    click.echo(json.dumps({"name": name, "claimName": claim, "message": message}, indent=2) if as_json else message)
