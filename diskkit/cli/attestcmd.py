"""`diskkit verify-attestation`: check the boot-test attestation `launcher test --attest-*` attached."""

from __future__ import annotations

import json
from pathlib import Path

import click

from diskkit.cli.shell import platform as platform_of
from diskkit.cli.shell import registry_options
from diskkit.registry.options import RegistryOptions

_FILE = click.Path(dir_okay=False, path_type=Path)


@click.command("verify-attestation", epilog="""\b
Examples:
  diskkit verify-attestation --key ci.pub quay.io/me/fedora:40
  diskkit verify-attestation --gpg-key ci.gpg --json quay.io/me/fedora:40
  diskkit verify-attestation --key ci.pub --allow-failed quay.io/me/fedora:40   # a failed test's record too
\b
Exit status: 0 an attestation holds; 8 none does (unsigned, another key, another digest,
a failed test); others as every command's.
""")
@click.argument("ref")
@click.option("--key", "keys", multiple=True, type=_FILE, metavar="FILE", help="A sigstore (cosign-format) public key that may have signed it (repeatable).")
@click.option("--gpg-key", "gpg_keys", multiple=True, type=_FILE, metavar="FILE", help="A GPG public keyring (binary or armoured) whose keys may have signed it (repeatable).")
@click.option("--allow-failed", is_flag=True, help="Accept an attestation of a failed boot test (it still must be signed and about this digest).")
@click.option("--platform", help="OS/ARCH of the image of an index (default: this host's).")
@click.option("--json", "as_json", is_flag=True, help="Print the accepted attestation's digest, referrer, signer and predicate.")
@registry_options
def verify_attestation(ref: str, keys: tuple[Path, ...], gpg_keys: tuple[Path, ...], allow_failed: bool, platform: str | None,
                       as_json: bool, registry: RegistryOptions) -> None:
    """Check that REF's manifest has a boot-test attestation (an in-toto statement in a DSSE
    envelope, attached as an OCI 1.1 referrer by `launcher test --attest-*`) signed by one of the
    keys, about that digest, of a test that passed. The predicate is diskkit's own: no other tool
    checks what it says."""
    from diskkit.ops.attest import verify

    if not keys and not gpg_keys:
        raise click.UsageError("give --key or --gpg-key: an attestation is checked against keys you trust")
    found = verify(ref, list(keys), list(gpg_keys), registry, platform_of(platform), require_pass=not allow_failed)
    if as_json:
        click.echo(json.dumps({"digest": found.digest, "referrer": found.referrer, "signer": found.signer, "predicate": found.predicate}, indent=2))
    else:
        p = found.predicate
        ssh = f", ssh {p['bootToSshSeconds']} s after boot" if p.get("bootToSshSeconds") is not None else ""
        click.echo(f"OK {ref}: {found.digest} boot-tested ({p.get('result')}, {p.get('command')!r}{ssh}) at {p.get('timestamp')}, signed by {found.signer}")

