"""Dedicated CPUs: pin each vCPU (and the emulator thread) to a host thread the pod owns exclusively.

KubeVirt's relaxed pool (pkg/virt-launcher/virtwrap/converter/vcpu): guest cores go first onto whole host
cores with enough free sibling threads, then onto leftover threads within one NUMA cell, then anywhere;
the emulator thread takes the first thread left. Pure: launcher.runtime.hostcpus reads the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from diskkit.errors import DiskkitError

# cells -> cores -> host thread ids, in the host's reporting order
Topology = tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True)
class CPUTune:
    vcpupin: tuple[int, ...]  # host thread of vCPU 0, 1, ...
    emulatorpin: int | None = None
    iothreadpin: tuple[tuple[int, str], ...] = ()  # (iothread id, cpuset)


class _Cell:
    def __init__(self, cores: list[list[int]], per_core: int):
        self.per_core = per_core
        self.full = [list(c) for c in cores if len(c) >= per_core]
        self.fragments = [t for c in cores if len(c) < per_core for t in c]

    def _take_from_full(self, count: int) -> list[int]:
        chosen, rest = self.full[0][:count], self.full[0][count:]
        if len(rest) >= self.per_core:
            self.full[0] = rest
        else:
            self.full.pop(0)
            self.fragments.extend(rest)
        return chosen

    def whole_core(self) -> list[int]:
        return self._take_from_full(self.per_core) if self.full else []

    def fragment_core(self) -> list[int]:
        if len(self.fragments) < self.per_core:
            return []
        chosen, self.fragments = self.fragments[: self.per_core], self.fragments[self.per_core:]
        return chosen

    def fragments_up_to(self, count: int) -> list[int]:
        chosen, self.fragments = self.fragments[:count], self.fragments[count:]
        return chosen

    def thread(self) -> int | None:
        if self.fragments:
            return self.fragments.pop(0)
        if self.full:
            return self._take_from_full(1)[0]
        return None


def _cells(topology: Topology, cpuset: frozenset[int], per_core: int) -> list[_Cell]:
    # Only the pod's own threads count; a host core keeps its siblings together.
    return [_Cell([[t for t in core if t in cpuset] for core in cell], per_core) for cell in topology]


def _fit_cores(cells: list[_Cell], cores: int, per_core: int) -> tuple[list[int], int]:
    threads: list[int] = []
    for take in (_Cell.whole_core, _Cell.fragment_core):
        for cell in cells:
            while cores and (chunk := take(cell)):
                threads += chunk
                cores -= 1
        if not cores:
            return threads, 0
    wanted = cores * per_core  # relaxed: a guest core may span cells
    for cell in cells:
        chunk = cell.fragments_up_to(wanted)
        threads += chunk
        wanted -= len(chunk)
    return threads, wanted // per_core


def _iothread_pins(iothreads: int, vcpus: int, cpuset: list[int], emulator: int | None) -> tuple[tuple[int, str], ...]:
    # formatDomainIOThreadPin: beside an isolated emulator thread, or spread over the pod's CPUs.
    if emulator is not None:
        return ((1, str(emulator)),)
    if iothreads >= vcpus:
        return tuple((t, str(cpuset[t % vcpus])) for t in range(1, iothreads + 1))
    pins, start, extra = [], 0, vcpus % iothreads
    for t in range(1, iothreads + 1):
        size = vcpus // iothreads + (1 if t <= extra else 0)
        pins.append((t, ",".join(str(c) for c in cpuset[start:start + size])))
        start += size
    return tuple(pins)


def fit(topology: Topology, cpuset: tuple[int, ...], sockets: int, cores: int, threads: int,
        isolate_emulator: bool, iothreads: int = 0) -> CPUTune:
    """The cputune of a VMI with dedicatedCpuPlacement, or KubeVirt's error when the pod's CPUs don't fit."""
    cells = _cells(topology, frozenset(cpuset), threads)
    pinned, missing = _fit_cores(cells, sockets * cores, threads)
    if missing:
        raise DiskkitError("spec.domain.cpu.dedicatedCpuPlacement",
                           f"failed to format domain cputune: not enough exclusive threads provided, could not fit {missing} core(s)")
    emulator = None
    if isolate_emulator:
        emulator = next((t for cell in cells if (t := cell.thread()) is not None), None)
        if emulator is None:
            raise DiskkitError("spec.domain.cpu.isolateEmulatorThread",
                               "no CPU allocated for the emulation thread: no remaining unassigned threads")
    pins = _iothread_pins(iothreads, len(pinned), list(cpuset), emulator) if iothreads else ()
    return CPUTune(tuple(pinned), emulator, pins)
