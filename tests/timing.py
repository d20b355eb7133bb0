"""Where the suite's time goes: seconds and guest boots per test file, and the run against its budget.

Every run ends with a table of the slowest files (setup, call and teardown of their tests, summed),
how many guests each booted, and its share of the run, then how much of the machine sat idle and under
which files (IdleSampler: a run that is not CPU-bound waits somewhere), then the run's wall time against the budget
(DEVELOPERS' rule: the whole suite within 25 minutes on 2 cores). tests/README.md keeps the table of
a full run and the command that makes it.

A guest boot is a qemu-system process that appears while a test runs and names one of this run's
directories on its command line (its disks live there): libvirt starts qemu with an empty environment
and not as our child, so neither the process tree nor a marker variable would find it. /proc is read
every 0.2 s; a boot under TCG lasts seconds, so none is missed.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")  # seconds per file of a full run: --record-durations writes it
BUDGET_SECONDS = 25 * 60
TESTS_BUDGET_SECONDS = 20 * 60
QUICK_BUDGET_SECONDS = 5 * 60  # the quick tier's tests (--quick)
SHOWN = 25
IDLE_SHOWN = 10
QEMU_COMM = b"qemu-system-x86"  # /proc/PID/comm keeps 15 bytes of qemu-system-x86_64


class BootCounter:
    """Counts the qemu processes of this run, each charged to the file of the test that was running."""

    def __init__(self, roots: list[str]):
        self.roots = [root.encode() for root in roots]
        self.seen: set[int] = set(self._qemus())  # another run's guests are not ours
        self.current: str | None = None
        self.boots: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="boot-counter", daemon=True)
        self.thread.start()

    @staticmethod
    def _qemus() -> list[int]:
        found = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if Path(f"/proc/{pid}/comm").read_bytes().rstrip(b"\n") == QEMU_COMM:
                        found.append(int(pid))
                except OSError:
                    pass
        return found

    def _ours(self, pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        if any(arg.startswith(b"none") for arg, before in zip(argv[1:], argv) if before == b"-machine"):
            return False  # libvirt probing QEMU's capabilities (-machine none): no guest
        return any(root in arg for arg in argv for root in self.roots)

    def _watch(self) -> None:
        while not self.stopping.wait(0.2):
            for pid in self._qemus():
                if pid in self.seen:
                    continue
                self.seen.add(pid)
                if self._ours(pid):
                    with self.lock:
                        if self.current is not None:
                            self.boots[self.current] += 1

    def start_test(self, path: str) -> None:
        with self.lock:
            self.current = path

    def take(self, path: str) -> int:
        """The boots charged to `path` since the last take (reported with each test's teardown)."""
        with self.lock:
            return self.boots.pop(path, 0)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2)


class IdleSampler:
    """How much of the machine sat idle, a sample a second (/proc/stat): where a run that is not
    CPU-bound waits. Each second's idle cores are charged to the tests running then, by their share of it,
    so the files that wait (sleeps, timeouts meant to expire, polls) show up by name."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []  # (start, end, idle cores) in epoch seconds
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="idle-sampler", daemon=True)
        self.thread.start()

    @staticmethod
    def _idle_and_total() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user..steal

    def _watch(self) -> None:
        cores = os.cpu_count() or 1
        before, at = self._idle_and_total(), time.time()
        while not self.stopping.wait(1.0):
            now, when = self._idle_and_total(), time.time()
            total = now[1] - before[1]
            if total > 0:
                self.samples.append((at, when, cores * (now[0] - before[0]) / total))
            before, at = now, when

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2)


def idle_charged(samples: list[tuple[float, float, float]], spans: list[tuple[str, float, float]]) -> tuple[dict[str, float], float, float]:
    """Idle core-seconds charged to each file of `spans` (file, start, stop): each sample's (start, end,
    idle cores) shared among the spans running then, in proportion to their overlap with it; with the idle
    core-seconds of the whole run and its length in samples' seconds."""
    per_file: dict[str, float] = defaultdict(float)
    for start, end, idle in samples:
        running = [(path, min(end, stop) - max(start, begun)) for path, begun, stop in spans if begun < end and stop > start]
        shared = sum(overlap for _, overlap in running)
        for path, overlap in running:
            per_file[path] += idle * (end - start) * overlap / shared
    seconds = sum(end - start for start, end, _ in samples)
    return per_file, sum(idle * (end - start) for start, end, idle in samples), seconds


class Timing:
    """The pytest plugin: per-file seconds and boots, printed at the end of the run."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)
        self.boots: dict[str, int] = defaultdict(int)
        self.tests: dict[str, int] = defaultdict(int)
        self.per_test: dict[str, list] = defaultdict(lambda: [0.0, 0])  # nodeid -> [seconds, boots]
        self.counter: BootCounter | None = None
        self.spans: list[tuple[str, float, float]] = []  # (file, start, stop) of each test phase
        self.idle = IdleSampler() if not hasattr(config, "workerinput") else None

    # --- in the process that runs the tests (a worker, or the only process) ---
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        if not hasattr(self.config, "workerinput") and self.config.pluginmanager.hasplugin("dsession"):
            return  # the xdist controller runs no test
        roots = [tempfile.gettempdir()]  # scratch dirs and pytest's basetemp are below it
        self.counter = BootCounter(roots)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        if self.counter is not None:
            self.counter.start_test(item.location[0])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when == "teardown" and self.counter is not None:
            report.user_properties.append(("guest_boots", self.counter.take(item.location[0])))

    def pytest_sessionfinish(self, session):
        if self.counter is not None:
            self.counter.stop()

    # --- where reports arrive (the controller under xdist) ---
    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += report.duration
        if getattr(report, "start", None) and getattr(report, "stop", None):
            self.spans.append((path, report.start, report.stop))
        self.per_test[report.nodeid][0] += report.duration
        if report.when == "call":
            self.tests[path] += 1
        for key, value in report.user_properties:
            if key == "guest_boots":
                self.boots[path] += value
                self.per_test[report.nodeid][1] += value

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        if self.config.getoption("--record-durations", False):
            record(self.seconds, self.per_test)
        wall = time.monotonic() - self.started
        total = sum(self.seconds.values())
        write = terminalreporter.write_line
        terminalreporter.section("seconds per test file")
        write(f"{'seconds':>8} {'share':>6} {'tests':>5} {'boots':>5}  file")
        for path, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SHOWN]:
            write(f"{seconds:8.1f} {seconds / total:6.1%} {self.tests[path]:5d} {self.boots[path]:5d}  {path}")
        rest = sorted(self.seconds)[SHOWN:] if len(self.seconds) > SHOWN else []
        if rest:
            shown = sum(sorted(self.seconds.values(), reverse=True)[:SHOWN])
            write(f"{total - shown:8.1f} {(total - shown) / total:6.1%}  the other {len(self.seconds) - SHOWN} files")
        write(f"{total:8.1f}  in tests ({sum(self.tests.values())} tests, {sum(self.boots.values())} guest boots)")
        if self.idle is not None:
            self.idle.stop()
            self._idle_table(write)
        write(budget_line(wall, self.config.getoption("--quick", False)))

    def _idle_table(self, write) -> None:
        per_file, idle, seconds = idle_charged(self.idle.samples, self.spans)
        if not seconds:
            return
        cores = os.cpu_count() or 1
        write(f"the machine's {cores} cores sat idle {idle / (cores * seconds):.0%} of the run; the files it idled under most "
              f"(idle core-seconds while they ran, shared among the files running):")
        for path, charged in sorted(per_file.items(), key=lambda kv: -kv[1])[:IDLE_SHOWN]:
            write(f"{charged:8.1f}  {path}")


def budget_line(wall: float, quick: bool) -> str:
    """The run's wall time against its tier's budget: the quick tier's, or the whole suite's tests' and CI run's."""
    budget, whose = (QUICK_BUDGET_SECONDS, "the quick tier's") if quick else (TESTS_BUDGET_SECONDS, "the tests'")
    line = f"wall time {wall / 60:.1f} min: {'within' if wall <= budget else 'OVER'} {whose} budget of {budget // 60} min"
    return line if quick else f"{line} (the whole CI run, set-up included: {BUDGET_SECONDS // 60} min)"


def recorded() -> dict:
    """{"files": {path: seconds}, "tests": {nodeid: [seconds, guest boots]}} of the runs recorded."""
    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {"files": {}, "tests": {}}
    return {"files": data.get("files", {}), "tests": data.get("tests", {})}


def record(files: dict[str, float], tests: dict[str, list]) -> None:
    """What this run measured, over what earlier runs recorded for the files it did not run."""
    data = recorded()
    data["files"].update({path: round(seconds, 1) for path, seconds in files.items()})
    data["tests"].update({nodeid: [round(seconds, 1), boots] for nodeid, (seconds, boots) in tests.items()})
    sections = []
    for key in ("files", "tests"):
        rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(value)}" for name, value in sorted(data[key].items()))
        sections.append(f' "{key}": {{\n{rows}\n }}')
    DURATIONS.write_text("{\n" + ",\n".join(sections) + "\n}\n")  # a line a file or test: diffs stay readable


def file_order(items) -> dict[str, int]:
    """Each test file's place in the run, longest first: its seconds in DURATIONS, else 60 s per test
    that boots a guest and 1 s per other test; ties in collection order."""
    known = recorded()["files"]
    guess: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        path = item.location[0]
        first.setdefault(path, index)
        guess[path] += 60 if item.get_closest_marker("vm") else 1
    weight = {path: known.get(path, guess[path]) for path in first}
    ranked = sorted(first, key=lambda path: (-weight[path], first[path]))
    return {path: rank for rank, path in enumerate(ranked)}


def add_options(parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each test file's seconds to {DURATIONS.name}, the order of the next runs")


def register(config: pytest.Config) -> None:
    config.pluginmanager.register(Timing(config), "diskkit-timing")


def count_boots_below(config: pytest.Config, root: Path) -> None:
    """Disks made below `root` (pytest's base directory, known once it is made) count too."""
    plugin = config.pluginmanager.get_plugin("diskkit-timing")
    if plugin is not None and plugin.counter is not None:
        plugin.counter.roots.append(str(root).encode())
