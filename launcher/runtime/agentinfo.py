"""What KubeVirt makes of a guest agent's answers (pure): the objects `virtctl guestosinfo`, `userlist`
and `fslist` print, and the conditions virt-handler sets for the agent.

The objects are KubeVirt's (staging/src/kubevirt.io/api/core/v1/types.go:
VirtualMachineInstanceGuestAgentInfo, VirtualMachineInstanceGuestOSUserList,
VirtualMachineInstanceFileSystemList), filled as virt-launcher fills them
(pkg/virt-launcher/virtwrap/manager.go GetGuestInfo, GetUsers, GetFilesystems, from the agent
poller's guest-info and guest-get-fsinfo answers and libvirt's guest info, agent-poller/agent_poller.go
and agent_parser.go) and printed as virtctl prints them (encoding/json MarshalIndent, two spaces).
Everything here comes from the guest: only what fits the object's types is kept.
"""

from __future__ import annotations

import json
from typing import Any

AGENT_CONNECTED = "AgentConnected"
UNSUPPORTED_AGENT = "UnsupportedAgent"
ACCESS_CREDENTIALS_SYNCHRONIZED = "AccessCredentialsSynchronized"
AGENT_NOT_CONNECTED = "VMI does not have guest agent connected"  # pkg/virt-api/rest/subresource.go vmiGuestAgentErr
GUEST_INFO_LIMIT = 10  # manager.go GetGuestInfo: GetFS(10), GetUsers(10)

# pkg/virt-handler/guestagent.go
REQUIRED_COMMANDS = ("guest-ping", "guest-get-time", "guest-info", "guest-shutdown", "guest-network-get-interfaces",
                     "guest-get-fsinfo", "guest-get-host-name", "guest-get-users", "guest-get-timezone", "guest-get-osinfo")
SSH_COMMANDS = ("guest-ssh-get-authorized-keys", "guest-ssh-add-authorized-keys", "guest-ssh-remove-authorized-keys")
OLD_SSH_COMMANDS = ("guest-exec-status", "guest-exec", "guest-file-open", "guest-file-close", "guest-file-read", "guest-file-write")

# libvirt's guest info parameters -> VirtualMachineInstanceGuestOSInfo, in the struct's order
_OS_FIELDS = (("name", "os.name"), ("kernelRelease", "os.kernel-release"), ("version", "os.version"),
              ("prettyName", "os.pretty-name"), ("versionId", "os.version-id"), ("kernelVersion", "os.kernel-version"),
              ("machine", "os.machine"), ("id", "os.id"))


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def agent_return(answer: str) -> Any:
    """The `return` member of an agent command's JSON answer; None when there is none."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return None
    return doc.get("return") if isinstance(doc, dict) else None


def supported_commands(guest_info_return: Any) -> list[dict]:
    """agent_parser.go parseAgent: guest-info's supported_commands as GuestAgentCommandInfo."""
    commands = guest_info_return.get("supported_commands") if isinstance(guest_info_return, dict) else None
    found = []
    for command in commands if isinstance(commands, list) else []:
        if isinstance(command, dict) and isinstance(command.get("name"), str):
            item = {"name": command["name"]}
            if command.get("enabled") is True:
                item["enabled"] = True  # omitempty
            found.append(item)
    return found


def filesystems(fsinfo_return: Any) -> list[dict]:
    """agent_parser.go parseFilesystem and manager.go GetFilesystems: each guest-get-fsinfo entry as a
    VirtualMachineInstanceFileSystem."""
    found = []
    for fs in fsinfo_return if isinstance(fsinfo_return, list) else []:
        if not isinstance(fs, dict):
            continue
        item = {"diskName": _str(fs.get("name")), "mountPoint": _str(fs.get("mountpoint")), "fileSystemType": _str(fs.get("type")),
                "usedBytes": _int(fs.get("used-bytes")), "totalBytes": _int(fs.get("total-bytes"))}
        disks = []
        for disk in fs.get("disk") if isinstance(fs.get("disk"), list) else []:
            if isinstance(disk, dict):
                entry = {"serial": _str(disk.get("serial"))} if _str(disk.get("serial")) else {}
                entry["busType"] = _str(disk.get("bus-type"))
                disks.append(entry)
        if disks:  # omitempty
            item["disk"] = disks
        found.append(item)
    return found


def _login_time(millis: Any) -> float:
    """agent_poller.go convertToUsers: libvirt's login time in milliseconds, as seconds."""
    return _int(millis) / 1000 if 0 <= _int(millis) < 2**63 else 0.0


def users(params: dict) -> list[dict]:
    """libvirt's user.N.* guest info as VirtualMachineInstanceGuestOSUser (domain, loginTime omitempty)."""
    found = []
    for i in range(min(_int(params.get("user.count")), 1 << 16)):
        item = {"userName": _str(params.get(f"user.{i}.name"))}
        if _str(params.get(f"user.{i}.domain")):
            item["domain"] = params[f"user.{i}.domain"]
        login = _login_time(params.get(f"user.{i}.login-time"))
        if login:
            item["loginTime"] = login
        found.append(item)
    return found


def guest_os_info(commands: list[dict], params: dict, fs: list[dict], fsfreeze: str | None, version: str) -> dict:
    """manager.go GetGuestInfo: VirtualMachineInstanceGuestAgentInfo, with at most ten users and file
    systems; the os and fsInfo members are structs, so there even when empty."""
    info: dict[str, Any] = {}
    if version:
        info["guestAgentVersion"] = version
    if commands:
        info["supportedCommands"] = commands
    if _str(params.get("hostname")):
        info["hostname"] = params["hostname"]
    info["os"] = {key: params[param] for key, param in _OS_FIELDS if _str(params.get(param))}
    info["timezone"] = f"{_str(params.get('timezone.name'))}, {_int(params.get('timezone.offset'))}"
    listed = users(params)[:GUEST_INFO_LIMIT]
    if listed:
        info["userList"] = listed
    info["fsInfo"] = {"disks": fs[:GUEST_INFO_LIMIT] or None}
    if fsfreeze:
        info["fsFreezeStatus"] = fsfreeze
    return info


def item_list(items: list[dict]) -> dict:
    """A VirtualMachineInstanceGuestOSUserList or VirtualMachineInstanceFileSystemList: empty list meta, items."""
    return {"metadata": {}, "items": items}


def _go_floats(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() else value  # Go prints 1700000000, not 1700000000.0
    if isinstance(value, dict):
        return {k: _go_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_go_floats(v) for v in value]
    return value


def go_json(value: Any) -> str:
    """json.MarshalIndent(value, "", "  ") as Go writes it: UTF-8 kept, <, >, & and the line and
    paragraph separators escaped."""
    text = json.dumps(_go_floats(value), indent=2, ensure_ascii=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def unsupported_reason(commands: list[dict], ssh_keys: bool) -> str | None:
    """virt-handler's isGuestAgentSupported: why the agent gets the UnsupportedAgent condition, or None."""
    enabled = {c["name"] for c in commands if c.get("enabled")}
    if not set(REQUIRED_COMMANDS) <= enabled:
        return "This guest agent doesn't support required basic commands"
    if ssh_keys and not (set(SSH_COMMANDS) <= enabled or set(OLD_SSH_COMMANDS) <= enabled):
        return "This guest agent doesn't support required public key commands"
    return None
