"""The downwardMetrics disk: vhostmd's metrics disk, as KubeVirt writes it (pkg/downwardmetrics).

A 256 KiB raw file: a 16-byte big-endian header (signature `mvbd`, a busy flag, the byte sum of the
body, the body's length) and the body, XML metrics as Go's xml.MarshalIndent prints them plus a
newline. Writers set the flag while the body changes, so `vm-dump-metrics` in the guest never reads
half a document. virt-handler refreshes it every 5 s; `launcher run` does the same from a thread.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence
from xml.sax.saxutils import escape, quoteattr

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import publishing

SIZE = 262144
SIGNATURE = b"mvbd"
HEADER = struct.Struct(">4siii")
MAX_BODY = SIZE - 24  # KubeVirt's limit (it keeps 8 bytes more than the header needs)
REFRESH_SECONDS = 5.0  # DownwardmetricsRefreshDuration
DISK_PATH = "downwardapi-disks/vhostmd0"  # config.DownwardMetricDisk, under /var/run/kubevirt-private


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # real64, uint64, int64, string, ...
    context: str  # host | vm
    value: str
    unit: str | None = None


def _metric(name: str, value, context: str, unit: str | None = None) -> Metric:
    """metrics.ToMetric: the type follows Go's, floats as %.6f."""
    if isinstance(value, float):
        return Metric(name, "real64", context, f"{value:.6f}", unit)
    if isinstance(value, str):
        return Metric(name, "string", context, value, unit)
    return Metric(name, "uint64" if value >= 0 else "int64", context, str(value), unit)


def body(metrics: Sequence[Metric]) -> bytes:
    if not metrics:
        return b"<metrics></metrics>\n"
    lines = ["<metrics>"]
    for m in metrics:
        unit = f" unit={quoteattr(m.unit)}" if m.unit else ""
        value = f"<![CDATA[{m.value.replace(']]>', ']]]]><![CDATA[>')}]]>" if m.value else ""
        lines += [f"  <metric type={quoteattr(m.type)} context={quoteattr(m.context)}{unit}>",
                  f"    <name>{escape(m.name)}</name>",
                  f"    <value>{value}</value>",
                  "  </metric>"]
    lines.append("</metrics>")
    return "\n".join(lines).encode() + b"\n"


def header(payload: bytes, busy: bool) -> bytes:
    checksum = sum(payload) & 0xFFFFFFFF
    if checksum >= 1 << 31:  # an int32 in Go, wrapping
        checksum -= 1 << 32
    return HEADER.pack(SIGNATURE, 1 if busy else 0, checksum, len(payload))


def write(path: Path, metrics: Sequence[Metric]) -> None:
    """Rewrite the metrics in place (qemu has the file open): flag busy, body, flag clear."""
    payload = body(metrics)
    if len(payload) > MAX_BODY:
        raise DiskkitError(path, f"vhostmd metrics body is too big, expected a maximum of {MAX_BODY}, got {len(payload)}")
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, header(payload, True), 0)
        os.fsync(fd)
        os.pwrite(fd, payload, HEADER.size)
        os.pwrite(fd, header(payload, False), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def create(path: Path, finish: Callable[[Path], None] | None = None) -> Path:
    """A new metrics disk holding no metrics yet (CreateDisk), appearing whole or not at all."""
    with publishing(path, "created") as staging:
        with open(staging, "wb") as f:
            f.truncate(SIZE)
        write(staging, [])
        if finish is not None:
            finish(staging)
    return path


# ---------------------------------------------------------------- what is measured

@dataclass(frozen=True)
class VMStats:
    cpu_time_ns: int
    vcpus: int
    memory_kib: int


def vm_metrics(stats: VMStats) -> list[Metric]:
    """guestCPUMetrics and guestMemoryMetrics (no ballooning, so the balloon is the memory limit)."""
    return [
        _metric("TotalCPUTime", stats.cpu_time_ns / 1e9, "vm", "s"),
        _metric("ResourceProcessorLimit", stats.vcpus, "vm"),
        _metric("PhysicalMemoryAllocatedToVirtualSystem", stats.memory_kib, "vm", "KiB"),
        _metric("ResourceMemoryLimit", stats.memory_kib, "vm", "KiB"),
    ]


def _meminfo(proc: Path) -> dict[str, int]:
    values = {}
    for line in (proc / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0])
    return values


def _vmstat(proc: Path) -> dict[str, int]:
    values = {}
    for line in (proc / "vmstat").read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    return values


def host_metrics(proc: Path = Path("/proc"), sys: Path = Path("/sys"), now: float | None = None) -> list[Metric]:
    """hostMetricsCollector.Collect: physical CPU packages, CPU time, memory, paging, the time."""
    metrics = []
    packages = {p.read_text().strip() for p in sys.glob("devices/system/cpu/cpu[0-9]*/topology/physical_package_id")}
    if packages:
        metrics.append(Metric("NumberOfPhysicalCPUs", "int64", "host", str(len(packages))))
    fields = (proc / "stat").read_text().splitlines()[0].split()
    ticks = os.sysconf("SC_CLK_TCK")
    metrics.append(_metric("TotalCPUTime", sum(int(v) for v in fields[1:4]) / ticks, "host", "s"))  # user + nice + system
    mem = _meminfo(proc)
    get = lambda key: mem.get(key, 0)  # noqa: E731
    metrics += [
        _metric("FreePhysicalMemory", get("MemFree"), "host", "KiB"),
        _metric("FreeVirtualMemory", get("MemFree") + get("SwapFree"), "host", "KiB"),
        _metric("MemoryAllocatedToVirtualServers", max(0, get("MemTotal") - get("MemFree") - get("Buffers") - get("Cached")), "host", "KiB"),
        _metric("UsedVirtualMemory", max(0, get("MemTotal") + get("SwapTotal") - get("MemFree") - get("Cached") - get("Buffers")
                                           - get("SwapCached")), "host", "KiB"),
    ]
    vmstat = _vmstat(proc)
    page_kib = os.sysconf("SC_PAGESIZE") // 1024
    metrics += [
        _metric("PagedInMemory", vmstat.get("pswpin", 0) * page_kib, "host", "KiB"),
        _metric("PagedOutMemory", vmstat.get("pswpout", 0) * page_kib, "host", "KiB"),
        Metric("Time", "int64", "host", str(int(time.time() if now is None else now)), "s"),
    ]
    return metrics


def node_name() -> str:
    """virt-handler reports its node's name; in a pod NODE_NAME carries it (downward API env)."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def report(stats: VMStats, product: str, hostname: str | None = None) -> list[Metric]:
    """DownwardMetricsReporter.Report, in its order: static host facts, VM, then host metrics."""
    static = [("HostName", hostname or node_name()), ("HostSystemInfo", "linux"), ("VirtualizationVendor", "kubevirt.io"),
              ("VirtProductInfo", product)]
    return [_metric(name, value, "host") for name, value in static] + vm_metrics(stats) + host_metrics()


class Refresher:
    """Rewrites the disk every REFRESH_SECONDS with fresh metrics until stopped; `stats()` returns
    None once the VM is gone. Failures are kept (the first one) for the caller, never raised in the thread."""

    def __init__(self, path: Path, stats: Callable[[], VMStats | None], product: str, every: float = REFRESH_SECONDS):
        self.path, self.stats, self.product, self.every = path, stats, product, every
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.writes = 0
        self._thread = threading.Thread(target=self._run, name=f"vhostmd {path}", daemon=True)

    def start(self) -> Refresher:
        self._thread.start()
        return self

    def refresh(self) -> bool:
        stats = self.stats()
        if stats is None:
            return False
        write(self.path, report(stats, self.product))
        self.writes += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.refresh():
                    return
            except Exception as exc:  # noqa: BLE001 - kept for the caller; the VM goes on without fresh metrics
                self.error = self.error or exc
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
