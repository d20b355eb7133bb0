"""A running VM's qemu guest agent through libvirt: is it connected, and what `virtctl guestosinfo`,
`userlist` and `fslist` show of it (launcher.runtime.agentinfo shapes the answers).

virt-launcher polls the agent and virt-handler answers from what it gathered; here the agent is
asked when the command runs, with the same commands and libvirt calls (agent-poller/agent_poller.go:
guest-info, guest-get-fsinfo and guest-fsfreeze-status through qemuAgentCommand, the rest through
virDomainGetGuestInfo). virt-api refuses each while the VMI's AgentConnected condition is missing.
"""

from __future__ import annotations

from diskkit.errors import DiskkitError
from launcher.render.compute import GUEST_AGENT_CHANNEL
from launcher.runtime import agentinfo
from launcher.runtime.runner import Libvirt

AGENT_TIMEOUT = 10  # seconds an agent command may take (virt-launcher's guest exec uses 10 too)
# libvirt's VIR_DOMAIN_GUEST_INFO_* flags (their values are stable ABI)
GUEST_INFO_USERS, GUEST_INFO_OS, GUEST_INFO_TIMEZONE, GUEST_INFO_HOSTNAME = 1, 2, 4, 8


def connected(lv: Libvirt, domain: str) -> bool:
    """virt-handler's guestAgentConnected: the agent channel's target state is connected."""
    return lv.channel_connected(domain, GUEST_AGENT_CHANNEL)


def ping(lv: Libvirt, domain: str) -> bool:
    """guest-ping answers (access_credentials.go pingAgent)."""
    try:
        lv.agent_command(domain, '{"execute":"guest-ping"}', AGENT_TIMEOUT)
    except DiskkitError:
        return False
    return True


def _require(lv: Libvirt, domain: str, name: str) -> None:
    if not lv.active(domain):
        raise DiskkitError(name, "VMI is not running")
    if not connected(lv, domain):
        raise DiskkitError(name, agentinfo.AGENT_NOT_CONNECTED)


def _command(lv: Libvirt, domain: str, command: str):
    return agentinfo.agent_return(lv.agent_command(domain, f'{{"execute":"{command}"}}', AGENT_TIMEOUT))


def supported_commands(lv: Libvirt, domain: str) -> tuple[str, list[dict]]:
    """(the agent's version, its commands) from guest-info."""
    info = _command(lv, domain, "guest-info")
    version = info.get("version") if isinstance(info, dict) and isinstance(info.get("version"), str) else ""
    return version, agentinfo.supported_commands(info)


def guest_os_info(lv: Libvirt, domain: str, name: str) -> dict:
    _require(lv, domain, name)
    version, commands = supported_commands(lv, domain)
    params = lv.guest_info(domain, GUEST_INFO_OS | GUEST_INFO_HOSTNAME | GUEST_INFO_TIMEZONE | GUEST_INFO_USERS)
    fs = agentinfo.filesystems(_command(lv, domain, "guest-get-fsinfo"))
    freeze = _command(lv, domain, "guest-fsfreeze-status")
    return agentinfo.guest_os_info(commands, params, fs, freeze if isinstance(freeze, str) else None, version)


def user_list(lv: Libvirt, domain: str, name: str) -> dict:
    _require(lv, domain, name)
    return agentinfo.item_list(agentinfo.users(lv.guest_info(domain, GUEST_INFO_USERS)))


def filesystem_list(lv: Libvirt, domain: str, name: str) -> dict:
    _require(lv, domain, name)
    return agentinfo.item_list(agentinfo.filesystems(_command(lv, domain, "guest-get-fsinfo")))


def conditions(lv: Libvirt, domain: str, ssh_keys: bool) -> list[dict]:
    """virt-handler's updateGuestAgentConditions: AgentConnected while the agent's channel is
    connected, and UnsupportedAgent (with its reason) when the agent lacks commands KubeVirt needs,
    the public key ones too when `ssh_keys` (qemuGuestAgent access credentials)."""
    if not connected(lv, domain):
        return []
    found = [{"type": agentinfo.AGENT_CONNECTED, "status": "True"}]
    try:
        _, commands = supported_commands(lv, domain)
    except DiskkitError:
        return found  # it went away meanwhile: the next look tells
    reason = agentinfo.unsupported_reason(commands, ssh_keys)
    if reason:
        found.append({"type": agentinfo.UNSUPPORTED_AGENT, "status": "True", "reason": reason})
    return found
