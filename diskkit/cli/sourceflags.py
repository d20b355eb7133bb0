"""Flags for commands that read a disk from a file, an http(s) URL or stdin: the checksum it must
match, and (for commands without registry flags) how a dropped download is retried."""

from __future__ import annotations

import functools

import click

from diskkit.registry.options import RegistryOptions


def checksum_options(command):
    options = [
        click.option("--checksum", metavar="sha256:HEX", help="The digest (sha256 or sha512) the input's bytes must have, as downloaded (before decompression); checked before anything is written."),
        click.option("--checksum-file", metavar="URL|FILE", help="A GNU (`HEX  name`, `HEX *name`) or BSD (`SHA256 (name) = HEX`) checksum file; the input's entry is found by its file name."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def retry_options(command):
    """--retry-times and --retry-delay, folded into `registry: RegistryOptions` as registry_options does."""

    @functools.wraps(command)
    def wrapper(*args, retry_times, retry_delay, **kwargs):
        return command(*args, registry=RegistryOptions(retries=retry_times, backoff=retry_delay), **kwargs)

    wrapper = click.option("--retry-delay", type=click.FloatRange(0, 60), default=0.5, show_default=True, metavar="SECONDS", help="First backoff delay of a download; doubles per retry, with jitter (Retry-After wins).")(wrapper)
    return click.option("--retry-times", type=click.IntRange(0, 20), default=5, show_default=True, help="Retries of a download on connection errors, 408, 429 and 5xx (each resumes where it stopped).")(wrapper)
