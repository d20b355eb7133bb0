"""`diskkit standalone-sign` / `standalone-verify`: GPG simple signatures of local manifest files,
with skopeo's arguments and output (skopeo cmd/skopeo/signing.go)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from diskkit.errors import DiskkitError, VerifyFailed

_FILE = click.Path(dir_okay=False, path_type=Path)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DiskkitError(path, f"cannot read the {what}: {exc.strerror}") from None


@click.command("standalone-sign", epilog="""\b
Examples:
  diskkit standalone-sign manifest.json quay.io/me/fedora:40 3F1A...C0DE -o signature-1
  diskkit standalone-sign --passphrase-file pass manifest.json quay.io/me/fedora:40 3F1A...C0DE -o sig
""")
@click.argument("manifest", type=_FILE)
@click.argument("docker_reference")
@click.argument("fingerprint")
@click.option("-o", "--output", type=_FILE, required=True, metavar="SIGNATURE", help="Write the signature here.")
@click.option("--passphrase-file", type=_FILE, help="File that contains a passphrase for the key.")
@click.option("--json", "as_json", is_flag=True, help='Print {"signature": OUTPUT, "dockerReference": ..., "fingerprint": ...}.')
def standalone_sign(manifest: Path, docker_reference: str, fingerprint: str, output: Path, passphrase_file: Path | None, as_json: bool) -> None:
    """Sign MANIFEST's digest as DOCKER-REFERENCE with the GnuPG key FINGERPRINT ($GNUPGHOME), as
    `skopeo standalone-sign`: the signature is the binary OpenPGP message a lookaside store holds."""
    from diskkit.signing.keys import read_passphrase
    from diskkit.signing.simple import standalone_sign as sign
    from diskkit.streams.fsutil import write_atomic

    passphrase = read_passphrase(passphrase_file, "") if passphrase_file is not None else None
    write_atomic(output, sign(_read(manifest, "manifest"), docker_reference, fingerprint, passphrase))
    if as_json:
        click.echo(json.dumps({"signature": str(output), "dockerReference": docker_reference, "fingerprint": fingerprint}, indent=2))


@click.command("standalone-verify", epilog="""\b
Examples:
  diskkit standalone-verify --public-key-file ci.gpg manifest.json quay.io/me/fedora:40 any signature-1
  diskkit standalone-verify manifest.json quay.io/me/fedora:40 3F1A...C0DE,77AB...0001 signature-1
""")
@click.argument("manifest", type=_FILE)
@click.argument("docker_reference")
@click.argument("fingerprints")
@click.argument("signature", type=_FILE)
@click.option("--public-key-file", type=_FILE, help="File containing public keys. If not specified, will use local GPG keys.")
@click.option("--json", "as_json", is_flag=True, help='Print {"fingerprint": ..., "digest": ...}.')
def standalone_verify(manifest: Path, docker_reference: str, fingerprints: str, signature: Path, public_key_file: Path | None, as_json: bool) -> None:
    """Verify SIGNATURE of MANIFEST as DOCKER-REFERENCE by one of FINGERPRINTS (comma separated, or
    "any" key of --public-key-file), as `skopeo standalone-verify`; exit 8 when it does not verify."""
    from diskkit.signing.openpgp import InvalidSignature
    from diskkit.signing.simple import standalone_verify as verify

    wanted = fingerprints.split(",")
    if public_key_file is None and wanted == ["any"]:
        raise DiskkitError("any", "Cannot use any fingerprint without a public key file")
    keys = _read(public_key_file, "public keys") if public_key_file is not None else None
    try:
        fingerprint, digest = verify(_read(manifest, "manifest"), docker_reference, wanted, _read(signature, "signature"), keys)
    except InvalidSignature as exc:
        raise VerifyFailed(signature, f"Error verifying signature: {exc}") from None
    if as_json:
        click.echo(json.dumps({"fingerprint": fingerprint, "digest": digest}, indent=2))
    else:
        click.echo(f"Signature verified using fingerprint {fingerprint}, digest {digest}")
