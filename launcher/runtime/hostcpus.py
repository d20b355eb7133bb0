"""This host's CPUs as dedicated CPU placement sees them: the NUMA cells, cores and sibling threads from
sysfs, and the threads this process may run on."""

from __future__ import annotations

import os
from pathlib import Path

from launcher.render.cpupin import Topology


def cpu_list(text: str) -> list[int]:
    """Linux cpu list syntax: `0-3,8,10-11`."""
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            out.extend(range(int(low), int(high or low) + 1))
    return out


def read_topology(sysfs: Path = Path("/sys/devices/system")) -> Topology:
    """Cells, cores and sibling threads of this host, as libvirt's capabilities report them."""
    nodes = sorted(sysfs.glob("node/node[0-9]*"), key=lambda p: int(p.name[4:]))
    cells = [cpu_list((n / "cpulist").read_text()) for n in nodes] or [cpu_list((sysfs / "cpu/online").read_text())]
    topology, seen = [], set()
    for cell in cells:
        cores = []
        for cpu in cell:
            if cpu in seen:
                continue
            siblings_file = sysfs / f"cpu/cpu{cpu}/topology/thread_siblings_list"
            siblings = cpu_list(siblings_file.read_text()) if siblings_file.exists() else [cpu]
            seen.update(siblings)
            cores.append(tuple(siblings))
        topology.append(tuple(cores))
    return tuple(topology)


def pod_cpuset() -> tuple[int, ...]:
    """The threads this process may run on: in a pod with the static CPU manager, the exclusive ones."""
    return tuple(sorted(os.sched_getaffinity(0)))
