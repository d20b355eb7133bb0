"""What `launcher status`, `ls`, `gc`, `stop`, `pause` and `unpause` make of a VM's record and its
domain, answered by libvirt's test driver (`test:///default`, as virt-manager's tests use it): no guest
boots. The driver's node lives in this process while a connection to it is open, so each test holds one
(`node`) and runs the commands in-process (diskkit.cli.shell.run_command, run_main's error lines and
exit statuses): a `launcher` process of its own would see a fresh node.

KubeVirt's words and rules, read in its source: virt-api refuses a pause or unpause (PauseVMIRequestHandler
and UnpauseVMIRequestHandler in pkg/virt-api/rest/lifecycle.go, the messages pkg/virt-api/rest/subresource.go's:
"VM is not running" in the pause handler, "VMI is not running" in the unpause one, "VMI is already paused",
"VMI is not paused", "Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported"); virt-handler
sets the Paused condition, reason PausedByUser, "VMI was paused by user" (pkg/virt-handler/vm.go); a
user-paused VMI stays healthy to its probes (isPausedButHealthy, pkg/virt-launcher/virtwrap/manager.go);
its stop subresource answers "VM is not running" for a VM that does not run (pkg/virt-api/rest/lifecycle.go).
What a guest and qemu do under these commands is tests/test_pause.py's and tests/test_stop.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from diskkit.cli.shell import run_command
from diskkit.errors import DiskkitError, Exit, NotFound
from launcher.cli.commands import cli
from launcher.node.cache import Cache
from launcher.runtime import gc, lookup, pausing, vms
from launcher.runtime.conditions import PAUSED_BY_USER, Paused
from launcher.runtime.runner import Libvirt
from tests.conftest import Result
from tests.testdriver import TEST_URI, close_node

UNREACHABLE_URI = "test:///nonexistent/node.xml"  # the test driver cannot read it: no libvirt answers
BY_USER = Paused(PAUSED_BY_USER, "VMI was paused by user")
STATES = ("running", "paused", "stopped", "gone")


@dataclass
class Node:
    lv: Libvirt
    cache: Cache

    def vm(self, name: str, state: str, uri: str = TEST_URI, **fields) -> dict:
        """A VM record as `launcher run` writes one (launcher.runtime.vms.run), its run directory and a
        disk entry it uses, and its domain `state` on the test driver: running, paused (by the user),
        stopped (defined, never started or shut off) or gone (no domain)."""
        domain = f"default_{name}"
        if state != "gone":
            defined = self.lv.conn.defineXML(f"<domain type='test'><name>{domain}</name><memory unit='KiB'>65536</memory>"
                                             "<os><type>hvm</type></os></domain>")
            if state in ("running", "paused"):
                defined.create()
            if state == "paused":
                defined.suspend()
        entry = self.disk(name)
        entry.mkdir(parents=True)
        (entry / "disk.img").write_bytes(b"\0" * 4096)
        (entry / "meta.json").write_text(json.dumps({"format": "qcow2", "layer": f"sha256:{name}"}))
        run_dir = self.cache.run_dir(domain)
        run_dir.mkdir(parents=True)
        (run_dir / "console.log").write_text("")
        record = {"domain": domain, "vmi": name, "namespace": "default", "uri": uri, "run_dir": str(run_dir),
                  "images": [f"registry.example/{name}:v1"], "entries": [str(entry)], "secrets": [], "virtiofsd": [],
                  "network": [], "livenessProbe": None, "gracePeriod": 30, "dropTPMState": False, "keptState": {}, "accessCredentials": []}
        record.update(fields)
        self.cache.write_json(self.cache.vm_record_path(domain), record)
        return record

    def disk(self, name: str) -> Path:
        """Where the disk entry of the VM `name` is (what Cache.disks lists)."""
        return self.cache.root / "disks" / "sha256" / "ab" / name.encode().hex().ljust(64, "0")

    def files_of(self, record: dict) -> list[Path]:
        return [p for p in (self.cache.vm_record_path(record["domain"]), Path(record["run_dir"])) if p.exists()]

    def state(self, domain: str) -> tuple[int, int] | None:
        """libvirt's own (state, reason) of the domain, None when it is not defined."""
        try:
            return tuple(self.lv.conn.lookupByName(domain).state())
        except self.lv.lv.libvirtError:
            return None


@pytest.fixture
def node(tmp_path):
    lv = Libvirt(TEST_URI)  # held for the test: the driver's node lives while a connection to it is open
    yield Node(lv, Cache(tmp_path / "cache"))
    close_node(lv)


@pytest.fixture
def launcher(node, capsys):
    """`launcher ARGS --cache-dir` of the node's cache, run in this process."""
    capsys.readouterr()

    def run(*args: str) -> Result:
        try:
            run_command(cli, "launcher", [*args, "--cache-dir", str(node.cache.root)])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return run


@pytest.mark.parametrize("state, condition", [("running", None), ("paused", BY_USER), ("stopped", None), ("gone", None)])
def test_the_state_is_libvirts_and_a_users_pause_is_kubevirts_paused_by_user(node, state, condition):
    record = node.vm("vm", state)
    assert lookup.state_and_why(record, node.cache) == (state, condition)
    assert lookup.state(record, node.cache) == state  # what `ls` and gc ask


def test_a_vm_whose_libvirt_cannot_be_reached_is_unknown(node):
    assert lookup.state_and_why(node.vm("vm", "gone", uri=UNREACHABLE_URI), node.cache) == ("unknown", None)


@pytest.mark.parametrize("state, code, line", [
    ("running", 0, "running"),
    # Healthy to a pod's probe: KubeVirt keeps a user-paused VMI Running (isPausedButHealthy).
    ("paused", 0, "paused (PausedByUser): VMI was paused by user"),
    ("stopped", 1, "stopped"),
    ("gone", 1, "gone"),
])
def test_status_says_the_state_and_exits_0_only_while_it_runs_or_the_user_paused_it(node, launcher, state, code, line):
    node.vm("vm", state)
    status = launcher("status", "vm")
    assert (status.code, status.out.strip()) == (code, line), status
    answer = json.loads(launcher("status", "--json", "vm").out)
    reason = (BY_USER.reason, BY_USER.message) if state == "paused" else (None, None)
    assert (answer["domain"], answer["state"], answer["reason"], answer["message"]) == ("default_vm", state, *reason), answer
    # The Paused condition as the VMI's status lists it; the test driver's domain has no guest agent channel.
    paused = [{"type": "Paused", "status": "True", "reason": BY_USER.reason, "message": BY_USER.message}]
    assert answer["conditions"] == (paused if state == "paused" else []), answer


def test_status_of_a_vm_never_started_here_is_not_found(node, launcher):
    missing = launcher("status", "vm")
    assert (missing.code, missing.err.strip()) == (Exit.NOT_FOUND, "launcher: vm: no VM of this name was started from this cache (yet)")


def test_pause_then_unpause_in_virtctls_words(node, launcher):
    node.vm("vm", "running")
    paused = launcher("pause", "--json", "vm")
    assert json.loads(paused.out) == {"name": "vm", "domain": "default_vm", "paused": True, "message": "VMI vm was paused"}, paused
    assert node.state("default_vm") == (node.lv.lv.VIR_DOMAIN_PAUSED, node.lv.lv.VIR_DOMAIN_PAUSED_USER)
    assert launcher("status", "vm").out.strip() == "paused (PausedByUser): VMI was paused by user"

    unpaused = launcher("unpause", "--json", "vm")
    assert json.loads(unpaused.out) == {"name": "vm", "domain": "default_vm", "unpaused": True, "was": "PausedByUser",
                                        "pausedAgain": None, "message": "VMI vm was unpaused"}, unpaused
    assert node.state("default_vm")[0] == node.lv.lv.VIR_DOMAIN_RUNNING
    status = launcher("status", "--json", "vm")
    assert (status.code, json.loads(status.out)["state"], json.loads(status.out)["reason"]) == (0, "running", None), status


@pytest.mark.parametrize("state, command, refusal", [
    ("paused", "pause", "VMI is already paused"),
    ("running", "unpause", "VMI is not paused"),
    ("stopped", "pause", "VM is not running"),  # sic: vmNotRunning in the pause handler
    ("stopped", "unpause", "VMI is not running"),  # vmiNotRunning in the unpause one
    ("gone", "pause", "VM is not running"),
    ("gone", "unpause", "VMI is not running"),
])
def test_pause_and_unpause_refusals_are_virt_apis_and_change_nothing(node, launcher, state, command, refusal):
    node.vm("vm", state)
    before = node.state("default_vm")
    refused = launcher(command, "vm")
    assert (refused.code, refused.out, refused.err.strip()) == (Exit.FAILED, "", f"launcher: vm: {refusal}"), refused
    as_json = launcher(command, "--json", "vm")
    assert json.loads(as_json.out)["error"]["message"] == f"vm: {refusal}", as_json
    assert node.state("default_vm") == before


@pytest.mark.parametrize("probe, refusal", [
    ("tcpSocket", "Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported"),
    ("guestAgentPing", None),  # virt-launcher excuses its ping failing for a user's pause
])
def test_the_recorded_liveness_probe_decides_the_pause(node, probe, refusal):
    node.vm("vm", "running", livenessProbe=probe)
    if refusal is None:
        assert pausing.pause(node.cache, "vm") == "default_vm"
        assert lookup.state_and_why(lookup.find_record(node.cache, "vm"), node.cache) == ("paused", BY_USER)
        return
    with pytest.raises(DiskkitError) as refused:
        pausing.pause(node.cache, "vm")
    assert refused.value.line() == f"vm: {refusal}"
    assert lookup.state(lookup.find_record(node.cache, "vm")) == "running"


@pytest.mark.parametrize("command", ["pause", "unpause"])
def test_pause_and_unpause_of_a_vm_not_recorded_here_are_not_found(node, launcher, command):
    gone = launcher(command, "vm")
    assert (gone.code, gone.err.strip()) == (Exit.NOT_FOUND, "launcher: vm: no VM of this name was started from this cache (yet)"), gone
    with pytest.raises(NotFound):
        getattr(pausing, command)(node.cache, "vm")


@pytest.mark.parametrize("state", ["gone", "stopped"])
def test_stop_of_a_vm_that_does_not_run_removes_its_files_and_says_not_running(node, launcher, state):
    """Its domain gone (the guest powered off, or its daemon with it) or defined and never started (its
    launcher killed in between): no VM was stopped, and nothing of it is left."""
    record = node.vm("vm", state)
    assert vms.stop(node.cache, "vm") is None
    assert node.files_of(record) == [] and node.state("default_vm") is None
    assert lookup.find_record(node.cache, "vm") is None
    stopped = launcher("stop", "--json", "vm")
    assert json.loads(stopped.out)["vms"] == [{"name": "vm", "stopped": False, "domain": None, "message": "VM vm is not running",
                                               "how": None, "gracePeriod": None, "seconds": None}], stopped


def test_stop_of_a_vm_whose_libvirt_cannot_be_reached_removes_its_files(node):
    record = node.vm("vm", "gone", uri=UNREACHABLE_URI)
    said = []
    domain, stopped = vms.stop(node.cache, "vm", say=said.append)
    assert (domain, stopped.how) == ("default_vm", "unreachable"), stopped
    assert said == [f"default_vm: libvirt at {UNREACHABLE_URI} cannot be reached; only the VM's files were removed"]
    assert node.files_of(record) == []


def test_a_record_is_found_by_name_namespace_name_or_domain_name(node):
    record = node.vm("vm", "running")
    assert lookup.find_record(node.cache, "vm") == lookup.find_record(node.cache, "default/vm") == lookup.find_record(node.cache, "default_vm") == record
    assert lookup.find_record(node.cache, "other/vm") is None


def test_ls_lists_each_vm_with_its_state_and_the_disks_it_uses(node, launcher):
    for state in STATES:
        node.vm(state, state)
    listing = launcher("ls", "--json")
    assert listing.code == 0, listing
    answer = json.loads(listing.out)
    assert {vm["domain"]: vm["state"] for vm in answer["vms"]} == {f"default_{state}": state for state in STATES}
    assert {disk["path"]: disk["usedBy"] for disk in answer["disks"]} == {str(node.disk(s) / "disk.img"): [f"default_{s}"] for s in STATES}
    table = launcher("ls").out.splitlines()
    for state in STATES:
        assert any(line.split()[:3] == [f"default_{state}", state, f"registry.example/{state}:v1"] for line in table), table


def test_gc_keeps_a_running_or_paused_vm_and_what_it_uses_and_cleans_up_the_rest(node, launcher):
    """A paused VM (by the user, or waiting for space) is a live one: its guest goes on when unpaused."""
    records = {state: node.vm(state, state) for state in STATES}
    unknown = node.vm("unknown", "gone", uri=UNREACHABLE_URI)  # its VM may still run: kept too
    collected = json.loads(launcher("gc", "--json").out)
    assert sorted(collected["vms_cleaned"]) == ["default_gone", "default_stopped"], collected
    assert sorted(collected["removed"]) == sorted(str(node.disk(s)) for s in ("gone", "stopped")), collected
    for state in ("running", "paused"):
        assert node.files_of(records[state]) and node.disk(state).is_dir(), state
    assert node.files_of(unknown) and node.disk("unknown").is_dir()
    for state in ("gone", "stopped"):
        assert node.files_of(records[state]) == [], state
    assert node.state("default_stopped") is None  # undefined, as `launcher stop` does
    assert [lookup.state(records[s]) for s in ("running", "paused")] == ["running", "paused"]
    assert gc.collect(node.cache).vms_cleaned == []  # nothing more to clean
