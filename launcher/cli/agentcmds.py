"""`launcher guestosinfo`, `userlist` and `fslist`: what the VM's guest agent reports, printed as
`virtctl guestosinfo|userlist|fslist` print it (pkg/virtctl/vm/guestosinfo.go, user_list.go,
fs_list.go: the API's object as indented JSON)."""

from __future__ import annotations

import click

from launcher.cli.options import cache_option, node_cache


def _print(name: str, cache_dir: str | None, query) -> None:
    from launcher.runtime.agentinfo import go_json
    from launcher.runtime.lookup import connect, record_of

    cache = node_cache(cache_dir)
    record = record_of(cache, name)
    lv = connect(record)
    try:
        click.echo(go_json(query(lv, record["domain"], name)))
    finally:
        lv.close()


@click.command(epilog="""\b
Examples:
  launcher guestosinfo testvm
  launcher guestosinfo testvm | jq -r .os.prettyName
""")
@click.argument("name")
@cache_option
def guestosinfo(name, cache_dir) -> None:
    """Print what the guest agent says of the guest (NAME, NAMESPACE/NAME or domain name): agent
    version and commands, host name, operating system, time zone, up to ten users and file systems,
    as KubeVirt's VirtualMachineInstanceGuestAgentInfo.

    Needs the qemu guest agent running in the guest (its channel, org.qemu.guest_agent.0, is in every
    VM); until it connects: "VMI does not have guest agent connected", as virt-api says.
    """
    from launcher.runtime.guestagent import guest_os_info

    _print(name, cache_dir, guest_os_info)


@click.command(epilog="""\b
Examples:
  launcher userlist testvm
""")
@click.argument("name")
@cache_option
def userlist(name, cache_dir) -> None:
    """Print the users logged in to the guest, from its guest agent, as KubeVirt's
    VirtualMachineInstanceGuestOSUserList."""
    from launcher.runtime.guestagent import user_list

    _print(name, cache_dir, user_list)


@click.command(epilog="""\b
Examples:
  launcher fslist testvm
""")
@click.argument("name")
@cache_option
def fslist(name, cache_dir) -> None:
    """Print the guest's mounted file systems with their use, from its guest agent, as KubeVirt's
    VirtualMachineInstanceFileSystemList."""
    from launcher.runtime.guestagent import filesystem_list

    _print(name, cache_dir, filesystem_list)
