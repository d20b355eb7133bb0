"""`diskkit index create` and `diskkit index append`: a multi-platform index from per-architecture images."""

from __future__ import annotations

import json

import click

from diskkit.cli.shell import registry_options
from diskkit.errors import DiskkitError
from diskkit.progress import reporter_for
from diskkit.registry.options import RegistryOptions


def _annotations(values: tuple[str, ...]) -> dict[str, str]:
    """KEY=VALUE, or index:KEY=VALUE as docker buildx imagetools create takes it (the index is the only level here)."""
    out = {}
    for value in values:
        text = value.removeprefix("index:")
        key, sep, val = text.partition("=")
        if not sep or not key:
            raise DiskkitError(f"--annotation {value}", "must be [index:]KEY=VALUE")
        out[key] = val
    return out


def _report(result, as_json: bool) -> None:
    from diskkit.ops.index import platform_text

    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    for entry in result.entries:
        click.echo(f"{platform_text(entry.descriptor.platform)}\t{entry.descriptor.digest}\t{entry.source}", err=True)
    click.echo(result.digest)


_SHARED = [
    click.option("--annotation", multiple=True, metavar="[index:]KEY=VALUE", help="Index annotation (repeatable)."),
    click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the index's digest and each entry with its platform and source."),
]


def _shared(command):
    for option in reversed(_SHARED):
        command = option(command)
    return command


@click.group("index")
def index_group() -> None:
    """Assemble a multi-platform OCI index from images built in separate jobs (one per architecture)."""


@index_group.command("create", epilog="""\b
Examples:
  diskkit index create quay.io/me/fedora:40 quay.io/me/fedora:40-amd64 quay.io/me/fedora:40-arm64
  diskkit index create --tls-verify=false localhost:5000/f:40 oci:./x86:40 oci-archive:arm.tar --annotation index:org.opencontainers.image.version=40
""")
@click.argument("dest")
@click.argument("sources", metavar="SRC...", nargs=-1, required=True)
@_shared
@registry_options
def create_cmd(dest, sources, annotation, as_json, registry: RegistryOptions) -> None:
    """Write an index at DEST listing each SRC image (or each entry of an SRC index).

    Each image's platform is read from its config; its manifest is listed by digest, unchanged, and
    its blobs are copied into DEST's repository (mounted within one registry, skipped where there).
    Two images for one platform are refused before anything is written.
    """
    from diskkit.ops.index import assemble

    _report(assemble(dest, list(sources), registry, reporter_for(as_json), annotations=_annotations(annotation)), as_json)


@index_group.command("append", epilog="""\b
Examples:
  diskkit index append quay.io/me/fedora:40 quay.io/me/fedora:40-s390x
  diskkit index append --replace quay.io/me/fedora:40 quay.io/me/fedora:40-arm64   # a rebuilt arm64 image
""")
@click.argument("dest")
@click.argument("sources", metavar="SRC...", nargs=-1, required=True)
@click.option("--replace", is_flag=True, help="An SRC for a platform DEST already lists takes that entry's place (else refused).")
@_shared
@registry_options
def append_cmd(dest, sources, replace, annotation, as_json, registry: RegistryOptions) -> None:
    """Add each SRC image to the index at DEST, keeping its entries and annotations; DEST must exist."""
    from diskkit.ops.index import assemble

    _report(assemble(dest, list(sources), registry, reporter_for(as_json), append=True, replace=replace,
                     annotations=_annotations(annotation)), as_json)
