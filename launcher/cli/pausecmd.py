"""`launcher pause` and `launcher unpause`: freeze a running VM and let it go on, as `virtctl pause
vmi` and `virtctl unpause vmi` do."""

from __future__ import annotations

import json

import click

from launcher.cli.options import cache_option, node_cache, say


@click.command(epilog="""\b
Examples:
  launcher pause testvm
  launcher pause --json default/testvm
  launcher status testvm        # paused (PausedByUser): VMI was paused by user
""")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "domain", "paused", "message"}.')
@cache_option
def pause(name, as_json, cache_dir) -> None:
    """Pause a VM `launcher run` started (NAME, NAMESPACE/NAME or domain name): its vCPUs stop, its
    memory is kept, until `launcher unpause NAME` (or `launcher stop NAME`).

    Refused, as KubeVirt refuses it, when the VM is not running or is paused already (by the user,
    or by a disk's I/O error). `launcher status` then says paused, reason PausedByUser.
    """
    from launcher.runtime.pausing import pause as do_pause

    domain = do_pause(node_cache(cache_dir), name)
    message = f"VMI {name} was paused"  # virtctl's "VMI NAME was scheduled to pause"; done here once we return
    if as_json:
        click.echo(json.dumps({"name": name, "domain": domain, "paused": True, "message": message}, indent=2))
    else:
        click.echo(message)


@click.command(epilog="""\b
Examples:
  launcher unpause testvm
  launcher unpause --json default/testvm
  launcher unpause full-disk-vm     # after freeing space where its overlay lives
""")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "domain", "unpaused", "was", "pausedAgain", "message"}.')
@cache_option
def unpause(name, as_json, cache_dir) -> None:
    """Let a paused VM go on (NAME, NAMESPACE/NAME or domain name), whoever paused it.

    A VM a disk's I/O error paused (PausedIOError: its overlay's filesystem full, say) is resumed as
    KubeVirt resumes it: qemu retries the failed request, and when that fails again (the disk still
    full) the VM pauses again, said in one line. Refused, in KubeVirt's words, when the VM is not
    running or not paused.
    """
    from launcher.runtime.pausing import unpause as do_unpause

    done = do_unpause(node_cache(cache_dir), name)
    message = f"VMI {name} was unpaused"
    if done.paused_again and not as_json:
        say(f"note: VMI {name} paused again at once: {done.paused_again}; free what it needs, then unpause it again")
    if as_json:
        click.echo(json.dumps({"name": name, "domain": done.domain, "unpaused": True, "was": done.was.reason,
                               "pausedAgain": done.paused_again, "message": message}, indent=2))
    else:
        click.echo(message)
