"""`launcher port-forward`: virtctl port-forward for VMs the launcher runs."""

from __future__ import annotations

import shlex
import signal
import sys
import threading

import click

from launcher.cli.options import cache_option, node_cache


@click.command("port-forward", epilog="""\b
Examples:
  launcher port-forward vmi/testvm 8080:80          # 127.0.0.1:8080 -> the guest's port 80, until Ctrl-C
  launcher port-forward testvm 2222:22 8080:80 udp/5353:53
  launcher port-forward vmi/testvm/myns 8080:80     # virtctl's TYPE/NAME/NAMESPACE
  launcher port-forward --address 0.0.0.0 vmi/testvm 8080:80  # other hosts too (loopback peers: yours only)
  ssh -o ProxyCommand='launcher port-forward --stdio vmi/testvm 22' root@testvm
""")
@click.argument("target")
@click.argument("ports", nargs=-1, required=True)
@click.option("--address", default="127.0.0.1", show_default=True, help="Local address the ports are opened on.")
@click.option("--stdio", is_flag=True, help="Carry one TCP connection to the guest's port over stdin/stdout (one port only).")
@cache_option
def port_forward(target, ports, address, stdio, cache_dir) -> None:
    """Forward local ports to a running VM's guest ports ([PROTOCOL/]LOCAL[:REMOTE]; LOCAL 0 picks one).

    TARGET is vmi/NAME, vm/NAME, TYPE/NAME/NAMESPACE or a bare NAME. Any guest port can be reached,
    declared in the interface's `ports` or not. A connection over the loopback is served only from
    your own user's (or root's) processes.
    """
    from diskkit.errors import DiskkitError, NotFound
    from launcher.network.forward import Listener, network_of, parse_port, parse_target, pump_stdio
    from launcher.runtime.lookup import connect, find_record

    name = parse_target(target)
    forwards = [parse_port(p) for p in ports]
    record = find_record(node_cache(cache_dir), name)
    if record is None:
        raise NotFound(name, "no VM of this name was started from this cache")
    lv = connect(record)  # a VM's own daemon, never a socket its uid's next VM holds
    if not lv.active(record["domain"]):
        raise DiskkitError(name, "is not running")
    entry = network_of(record)
    if stdio:
        if len(forwards) != 1 or forwards[0].protocol != "tcp":
            raise DiskkitError("--stdio", "only one port supported when forwarding to stdout (TCP)")
        pump_stdio(entry, forwards[0].remote)
        return
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: done.set())
    listeners = []
    try:
        for forward in forwards:
            listeners.append(Listener(entry, forward, address))
            click.echo(f"Forwarding from {address}:{listeners[-1].local} -> {forward.remote} ({forward.protocol})")
            if (forward.protocol, forward.remote) == ("tcp", 22):
                _ssh_hint(node_cache(cache_dir), record, name, address, listeners[-1].local)
        for listener in listeners:
            listener.serve()
        sys.stdout.flush()
        # until Ctrl-C, or the VM goes (its forwards with it)
        while not done.wait(1.0):
            if not lv.active(record["domain"]):
                raise DiskkitError(name, "stopped; its forwards went with it")
    finally:
        for listener in listeners:
            listener.close()


def _ssh_hint(cache, record: dict, name: str, address: str, local: int) -> None:
    """How to ssh through the forward with the VM's own host keys (launcher.runtime.sshreach), once known."""
    from launcher.runtime.sshreach import settled_now, ssh_quote

    contact = settled_now(cache, record)
    if contact is None:
        click.echo(f"launcher: {name}'s host keys are not known yet (cloud-init prints them at first boot); "
                   f"`launcher ssh` waits for them", err=True)
        return
    known_hosts = shlex.quote(f"UserKnownHostsFile={ssh_quote(contact.known_hosts)}")
    click.echo(f"launcher: ssh with {name}'s host keys: ssh -o {known_hosts} -o HostKeyAlias={contact.alias} -p {local} USER@{address}", err=True)
