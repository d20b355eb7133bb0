"""`launcher console` and `launcher logs`: a running VM's serial console, as `virtctl console` and
`kubectl logs` give them."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from diskkit.errors import NotFound
from launcher.cli.options import cache_option, node_cache


def _running_record(cache, name: str) -> dict:
    from launcher.runtime.lookup import find_record

    record = find_record(cache, name)
    if record is None:
        raise NotFound(name, f"VM is not running (none of this name was started from the cache {cache.root})")
    return record


@click.command(epilog="""\b
Examples:
  launcher console testvm              # detach with Ctrl-]
  launcher console default/testvm
  printf 'root\\n' | launcher console testvm   # a line to the guest's serial port; the end of input detaches
""")
@click.argument("name")
@cache_option
def console(name, cache_dir) -> None:
    """Attach to the serial console of a VM `launcher run` started: what the guest prints from now
    on, and what you type goes to its serial port. Ctrl-] (or the end of input) detaches and
    leaves the VM running; `launcher logs NAME` shows what it printed before."""
    from launcher.runtime.attach import attach
    from launcher.runtime.runner import use_event_loop
    from launcher.runtime.lookup import connect

    cache = node_cache(cache_dir)
    record = _running_record(cache, name)
    use_event_loop()  # the console's stream is libvirt's event loop's to read and write
    lv = connect(record)
    try:
        if attach(lv, record["domain"], name) == "stopped":
            click.echo(f"launcher: {record['domain']} stopped", err=True)
    finally:
        lv.close()


@click.command(epilog="""\b
Examples:
  launcher logs testvm
  launcher logs -f testvm              # and what follows, until the VM stops (or Ctrl-C)
""")
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what the guest prints until it stops.")
@cache_option
def logs(name, follow, cache_dir) -> None:
    """Print a running VM's serial console log (everything the guest printed since it started)."""
    from launcher.runtime import rundir
    from launcher.runtime.console import ConsoleLog
    from launcher.runtime.console import follow as follow_log
    from launcher.runtime.lookup import connect

    cache = node_cache(cache_dir)
    record = _running_record(cache, name)
    # Read as the launcher follows it: through the console directory's fd, never through a link
    # the qemu user (who owns that directory) may have put there, across virtlogd's rotations.
    log = ConsoleLog(rundir.console_log(Path(record["run_dir"])))

    def echo(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    try:
        if not follow:
            while data := log.read():
                echo(data)
            return
        lv = connect(record)
        try:
            follow_log(log, lambda: lv.active(record["domain"]), echo=echo)
        except KeyboardInterrupt:
            pass
        finally:
            lv.close()
    finally:
        log.close()
