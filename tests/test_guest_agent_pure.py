"""What KubeVirt makes of a guest agent's answers, from answers a real agent gave (Debian 12's
qemu-guest-agent 7.2 in the cloud guest, tests/golden/agent/cloudguest-answers.json: guest-info,
guest-get-fsinfo and guest-fsfreeze-status through qemuAgentCommand, libvirt's guest info), shaped
as pkg/virt-launcher/virtwrap/manager.go GetGuestInfo / GetUsers / GetFilesystems and
agent-poller/agent_parser.go fill staging/src/kubevirt.io/api/core/v1/types.go's objects, printed
as virtctl prints them (encoding/json MarshalIndent); virt-handler's agent conditions
(pkg/virt-handler/guestagent.go); the VNC proxy's socket owner lookup; the viewer virtctl starts
(pkg/virtctl/vnc/vnc.go)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.cli.vnccmd import viewer_command
from launcher.runtime import agentinfo, credsync
from launcher.runtime.vnc import socket_owner

GOLDEN = Path(__file__).parent / "golden" / "agent"
RAW = json.loads((GOLDEN / "cloudguest-answers.json").read_text())


def test_guestosinfo_from_a_real_agents_answers():
    info = agentinfo.agent_return(RAW["guest-info"])
    shaped = agentinfo.guest_os_info(agentinfo.supported_commands(info), dict(RAW["guestInfo"]),
                                     agentinfo.filesystems(agentinfo.agent_return(RAW["guest-get-fsinfo"])),
                                     agentinfo.agent_return(RAW["guest-fsfreeze-status"]), info["version"])
    assert agentinfo.go_json(shaped) + "\n" == (GOLDEN / "guestosinfo.json").read_text()
    # GuestAgentCommandInfo's enabled is omitempty: a disabled command is its name alone
    assert {"name": "guest-get-devices"} in shaped["supportedCommands"]
    # no user logged in: userList (omitempty) is left out; fsInfo is a struct, always there
    assert "userList" not in shaped and shaped["fsInfo"]["disks"][0]["disk"] == [{"busType": "virtio"}]


def test_users_login_times_are_seconds_and_at_most_ten_in_guestosinfo():
    params = {"user.count": 12, **{f"user.{i}.name": f"u{i}" for i in range(12)},
              "user.0.login-time": 1764345678123, "user.1.login-time": 1764345679000, "user.1.domain": "CORP"}
    listed = agentinfo.users(params)
    assert listed[:3] == [{"userName": "u0", "loginTime": 1764345678.123}, {"userName": "u1", "domain": "CORP", "loginTime": 1764345679.0},
                          {"userName": "u2"}]
    assert len(agentinfo.guest_os_info([], params, [], None, "")["userList"]) == 10
    text = agentinfo.go_json(agentinfo.item_list(listed[:2]))
    # Go prints a whole float64 without a fraction
    assert '"loginTime": 1764345678.123' in text and '"loginTime": 1764345679\n' in text
    assert text.startswith('{\n  "metadata": {},\n  "items": [\n    {\n      "userName": "u0"')


def test_go_json_escapes_as_encoding_json_does():
    assert agentinfo.go_json({"a": "<b>&ü\u2028"}) == '{\n  "a": "\\u003cb\\u003e\\u0026ü\\u2028"\n}'
    # a guest's host name with a terminal escape in it reaches the terminal escaped
    assert agentinfo.go_json({"hostname": "x\x1b]0;owned\x07"}) == '{\n  "hostname": "x\\u001b]0;owned\\u0007"\n}'
    assert agentinfo.go_json({"items": []}) == '{\n  "items": []\n}'


def test_answers_that_are_not_the_objects_shape_leave_nothing_of_theirs():
    assert agentinfo.agent_return("not json") is None and agentinfo.agent_return('["x"]') is None
    assert agentinfo.supported_commands({"supported_commands": [{"name": 5}, "x", {"name": "guest-ping", "enabled": "yes"}]}) == [{"name": "guest-ping"}]
    assert agentinfo.filesystems([{"name": 1, "used-bytes": "9", "disk": [{"bus-type": None}]}, 3]) == [
        {"diskName": "", "mountPoint": "", "fileSystemType": "", "usedBytes": 0, "totalBytes": 0, "disk": [{"busType": ""}]}]
    assert agentinfo.users({"user.count": 2**40, "user.0.name": "a"})[0] == {"userName": "a"}  # the count is bounded


def test_agent_conditions_reason_as_virt_handler():
    commands = agentinfo.supported_commands(agentinfo.agent_return(RAW["guest-info"]))
    assert agentinfo.unsupported_reason(commands, ssh_keys=True) is None
    without_ssh = [c for c in commands if not c["name"].startswith(("guest-ssh-", "guest-exec"))]
    assert agentinfo.unsupported_reason(without_ssh, ssh_keys=False) is None
    assert agentinfo.unsupported_reason(without_ssh, ssh_keys=True) == "This guest agent doesn't support required public key commands"
    only_old = [c for c in commands if not c["name"].startswith("guest-ssh-")]  # guest-exec and guest-file-* do it too
    assert agentinfo.unsupported_reason(only_old, ssh_keys=True) is None
    no_users = [c for c in commands if c["name"] != "guest-get-users"]
    assert agentinfo.unsupported_reason(no_users, ssh_keys=False) == "This guest agent doesn't support required basic commands"


TCP = b"""  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000   107        0 111 1 0 100 0 0 10 0
   1: 0100007F:D2F0 0100007F:9C41 01 00000000:00000000 00:00000000 00000000 65534        0 222 1 0 20 4 30 10 -1
   2: 0100007F:9C41 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000   107        0 333 1 0 20 4 30 10 -1
"""
TCP6 = b"""  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:A000 00000000000000000000000001000000:9C41 01 00000000:00000000 00:00000000 00000000  1000        0 4 1
"""


def test_the_socket_owner_of_a_loopback_client_is_read_from_the_kernels_tables():
    # the client's end of 127.0.0.1:53999 -> 127.0.0.1:40001 (0x9C41) is nobody's; the accepted end, ours
    assert socket_owner([TCP], ("127.0.0.1", 0xD2F0), ("127.0.0.1", 0x9C41)) == 65534
    assert socket_owner([TCP], ("127.0.0.1", 0x9C41), ("127.0.0.1", 0xD2F0)) == 107
    assert socket_owner([TCP, TCP6], ("::1", 0xA000), ("::1", 0x9C41)) == 1000
    assert socket_owner([TCP], ("127.0.0.1", 1), ("127.0.0.1", 2)) is None


def test_the_viewer_is_virtctls_choice_with_its_arguments(tmp_path):
    found = {"remote-viewer": "/usr/bin/remote-viewer", "vncviewer": "/usr/bin/vncviewer"}
    assert viewer_command(None, None, "127.0.0.1", 5999, found.get) == ["/usr/bin/remote-viewer", "vnc://127.0.0.1:5999"]
    assert viewer_command(None, None, "127.0.0.1", 5999, {"vncviewer": "/v"}.get) == ["/v", "127.0.0.1:5999"]
    assert viewer_command("tiger", "/opt/vnc", "127.0.0.1", 5999, {}.get) == ["/opt/vnc", "127.0.0.1:5999"]
    with pytest.raises(DiskkitError) as err:
        viewer_command(None, None, "127.0.0.1", 5999, {}.get)
    assert str(err.value).startswith("vnc: could not find remote-viewer or vncviewer binary in $PATH")


def test_the_access_credentials_condition_is_what_the_helper_last_reported(tmp_path):
    # pkg/virt-handler/vm.go updateAccessCredentialConditions: status True, or False with the message
    assert credsync.condition(tmp_path) is None  # nothing reported yet: no condition
    credsync.write_state(tmp_path, credsync.Outcome(False, credsync.OFFLINE))
    assert credsync.condition(tmp_path) == {"type": "AccessCredentialsSynchronized", "status": "False", "message": "Guest agent is offline"}
    credsync.write_state(tmp_path, credsync.Outcome(True))
    assert credsync.condition(tmp_path) == {"type": "AccessCredentialsSynchronized", "status": "True"}
    (tmp_path / credsync.STATE_FILE).write_text("[1, 2]")
    assert credsync.condition(tmp_path) is None
