"""Shared fixtures: the real tools the suite depends on, and the diskkit CLI run as a process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distribution import auth_registry, registry, tls_registry, token_registry  # noqa: F401  (fixtures)
from tests.engines import dockerd, engine, podman  # noqa: F401  (fixtures)
from tests import cliserver, lanes, leftovers, timing
from tests.faultproxy import FaultProxy

REQUIRED_TOOLS = (
    "qemu-img", "qemu-io", "skopeo", "umoci", "buildah", "docker-registry", "qemu-system-x86_64", "xorriso",
    "virsh", "virt-xml-validate", "xmllint", "tgtd", "tgtadm", "setpriv", "losetup", "isoinfo", "nbdinfo", "nbdcopy",
    "go", "openssl", "gpg", "gpgconf",
    "podman", "mmdebstrap", "catatonit", "unshare", "flock",
    "libvirtd", "virtlogd", "nsenter",
    "ssh", "ssh-keygen", "dropbear",
)



def pytest_addoption(parser):
    timing.add_options(parser)
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: no test that boots a guest (marked vm) nor any marked slow")


def pytest_configure(config):
    worker = getattr(config, "workerinput", {}).get("workerid")
    # Every Python process the run starts can then tell its threads' tracebacks on SIGABRT (tests/stacks.py).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    lanes.enter_background(config)
    own = leftovers.begin(worker)
    if worker is None and not config.option.basetemp:
        # pytest's tmp_path below this run's directory, and short: unix sockets made in a test's
        # tmp_path (a disk server's, 50 bytes below it) must stay within 107 bytes with xdist's
        # popen-gwN added. Workers get theirs below it from xdist.
        config.option.basetemp = str(own.parent / "t")
    timing.register(config)


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") == "loadfile" and lanes.has_background(config):
        return lanes.GuestLanes(config, log)  # loadfile's grouping: two lanes for guests, a third in the background


@pytest.fixture(scope="session", autouse=True)
def _guest_boots_in_tmp_paths(request, tmp_path_factory):
    timing.count_boots_below(request.config, tmp_path_factory.getbasetemp())


def pytest_sessionstart(session):
    leftovers.install_handlers()  # SIGTERM/SIGHUP run the teardowns, as Ctrl-C does
    # A missing peer must fail the run loudly, never turn into a silent skip.
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise pytest.UsageError(f"tools missing for the test suite: {', '.join(missing)} (run .ci/run or scripts/setup.sh)")


# Tests that boot a guest (qemu under TCG, through libvirt or not) are the slow part of the suite:
# `-m 'not vm'` runs the rest in a few minutes. A test is one when it asks for a fixture that gives it
# a VM host, or calls qemu itself.
VM_FIXTURES = {"qemu_user", "session_user", "root_side", "daemon", "pod_image", "pair"}  # pair: test_trust_vmview's two VMs
VM_CALLS = {"boot_qemu", "start_qemu"}


def pytest_collection_modifyitems(config, items):
    measured = timing.recorded()["tests"]
    for item in items:
        function = getattr(item, "function", None)
        names = set(function.__code__.co_names) if function is not None else set()  # the globals it calls: no source read
        booted = measured.get(item.nodeid, [0, 0])[1] > 0  # a recorded run saw it boot one (tests/durations.json)
        if booted or VM_FIXTURES & set(getattr(item, "fixturenames", ())) or names & VM_CALLS:
            item.add_marker(pytest.mark.vm)
    if config.getoption("--quick"):
        # The quick tier: no guest, nor a test marked slow (its reason beside the mark). Not the recorded
        # run's durations: a test run in the background lane (tests/lanes.py) takes longer than it costs.
        slow = [item for item in items if item.get_closest_marker("vm") or item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            chosen = set(map(id, slow))
            items[:] = [item for item in items if id(item) not in chosen]
    # The longest files first (tests/durations.json, from a full run; unknown ones as long as their
    # boots suggest): two workers then end together rather than one idling while the other runs the
    # last long file. A file's tests keep their order and stay together, and every worker sorts alike.
    order = timing.file_order(items)
    items.sort(key=lambda item: order[item.location[0]])


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears the session's fixtures down
def pytest_sessionfinish(session):
    cliserver.CLIENT.stop()
    leftovers.sweep()  # scratch directories whose fixture never reached its cleanup
    leftovers.check_left_running()
    leaks = leftovers.leaks_of_run()
    if leaks:
        session.config.stash[LEAKS] = leaks
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


LEAKS = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, config):
    leaks = config.stash.get(LEAKS, [])
    if leaks:
        terminalreporter.section("processes the run left running (ended now)", red=True)
        for line in leaks:
            terminalreporter.write_line(line)


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def last_line(self) -> str:
        return self.out.strip().splitlines()[-1] if self.out.strip() else ""


def _command(module: str, args, user: str | None) -> list[str]:
    cmd = [sys.executable, "-m", module, *map(str, args)]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return cmd


def _run_cli(module: str, args, cwd: Path | None, env: dict | None, user: str | None, timeout: float | None) -> Result:
    full_env = {**os.environ, "CI": "true", **(env or {})}
    if cliserver.CLIENT.usable(full_env, user):
        return Result(*cliserver.CLIENT.run(module, [str(a) for a in args], cwd, full_env, timeout, user))
    proc = subprocess.run(_command(module, args, user), capture_output=True, text=True, cwd=cwd, env=full_env, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def run_diskkit(*args: str | os.PathLike, cwd: Path | None = None, env: dict | None = None, user: str | None = None) -> Result:
    return _run_cli("diskkit", args, cwd, env, user, None)


def sigstore_keys(directory: Path, passphrase: str, names: tuple[str, ...] = ("a", "b")) -> None:
    """Cosign-format key pairs NAME.private/NAME.pub in `directory`, made by `diskkit generate-sigstore-key`,
    all locked with `passphrase` (kept in `directory`/pass)."""
    (directory / "pass").write_text(passphrase + "\n")
    for name in names:
        r = run_diskkit("generate-sigstore-key", "--output-prefix", directory / name, "--passphrase-file", directory / "pass")
        assert r.code == 0, r.err


def launcher_command(*args: str | os.PathLike, user: str | None = None) -> list[str]:
    return _command("launcher", args, user)


def run_launcher(*args: str | os.PathLike, env: dict | None = None, user: str | None = None, timeout: float = 300) -> Result:
    return _run_cli("launcher", args, None, env, user, timeout)


@pytest.fixture
def diskkit():
    return run_diskkit


def make_qcow2(path: Path, size: str = "64M", pattern: int = 0xAB, extra: list[str] | None = None) -> Path:
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", *(extra or []), str(path), size], check=True)
    subprocess.run(["qemu-io", "-c", f"write -P {pattern} 0 1M", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture
def qcow2(tmp_path: Path) -> Path:
    return make_qcow2(tmp_path / "disk.qcow2")


@pytest.fixture
def raw_disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk.img"
    with open(path, "wb") as f:
        f.write(b"\xcd" * (1 << 20))
        f.truncate(32 << 20)
    return path


def run(*cmd: str | os.PathLike, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw)


@pytest.fixture
def fault_proxy():
    """A factory: fault_proxy(registry) puts a fault-injecting proxy in front of that registry."""
    proxies = []

    def make(target):
        proxy = FaultProxy(target.host)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()


# Fixtures defined beside the helpers they use; imported last, as those modules import this one.
from tests.tgt import iscsi_target  # noqa: E402,F401
from tests.vmhost import guest_image, qemu_user, root_side  # noqa: E402,F401
