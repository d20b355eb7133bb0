"""The `launcher` command line (its commands arrive with the runtime side)."""

from __future__ import annotations

import click

from diskkit import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="launcher")
def cli() -> None:
    """Boot KubeVirt-style VMs from containerDisk images."""


def main() -> None:
    cli()
