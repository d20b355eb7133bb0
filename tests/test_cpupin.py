"""Dedicated CPU placement: KubeVirt's relaxed pool, fed with host topologies and pod cpusets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.render import cpupin
from launcher.runtime import hostcpus

# one NUMA cell, six cores with two sibling threads each, reported in this (shuffled) order
SIX_BY_TWO = (((1, 7), (0, 6), (2, 8), (3, 9), (4, 10), (5, 11)),)


def test_single_thread_cores_follow_the_host_reporting_order():
    tune = cpupin.fit(SIX_BY_TWO, tuple(range(12)), sockets=1, cores=12, threads=1, isolate_emulator=False)
    assert tune.vcpupin == (1, 7, 0, 6, 2, 8, 3, 9, 4, 10, 5, 11)
    assert tune.emulatorpin is None


def test_guest_threads_land_on_sibling_host_threads():
    tune = cpupin.fit(SIX_BY_TWO, tuple(range(12)), sockets=1, cores=2, threads=2, isolate_emulator=True)
    assert tune.vcpupin == (1, 7, 0, 6)
    assert tune.emulatorpin == 2  # the first thread left over


def test_a_core_missing_a_sibling_is_used_for_fragments_last():
    # thread 7 is not the pod's: host core (1,7) can only take half a guest core
    cpuset = (0, 1, 2, 6, 8)
    tune = cpupin.fit(SIX_BY_TWO, cpuset, sockets=1, cores=2, threads=2, isolate_emulator=True)
    assert tune.vcpupin == (0, 6, 2, 8)
    assert tune.emulatorpin == 1


def test_too_few_threads_is_kubevirts_error():
    with pytest.raises(DiskkitError, match=r"not enough exclusive threads provided, could not fit 1 core\(s\)"):
        cpupin.fit(SIX_BY_TWO, tuple(range(11)), sockets=1, cores=12, threads=1, isolate_emulator=False)


def test_no_thread_left_for_the_emulator():
    with pytest.raises(DiskkitError, match="no CPU allocated for the emulation thread"):
        cpupin.fit(SIX_BY_TWO, (0, 6), sockets=1, cores=1, threads=2, isolate_emulator=True)


def test_guest_cores_may_span_cells_in_the_relaxed_pool():
    two_cells = (((0, 1),), ((2, 3),))
    tune = cpupin.fit(two_cells, (0, 2), sockets=1, cores=1, threads=2, isolate_emulator=False)
    assert tune.vcpupin == (0, 2)


def test_iothreads_share_the_isolated_emulator_thread():
    tune = cpupin.fit(SIX_BY_TWO, tuple(range(12)), 1, 2, 1, True, iothreads=3)
    assert tune.iothreadpin == ((1, str(tune.emulatorpin)),)


def test_iothreads_spread_over_the_pods_cpus():
    cpuset = tuple(range(8))
    single_threaded = (tuple((c,) for c in cpuset),)
    many = cpupin.fit(single_threaded, cpuset, 1, 2, 1, False, iothreads=3)  # more iothreads than vCPUs
    assert many.iothreadpin == ((1, "1"), (2, "0"), (3, "1"))
    few = cpupin.fit(single_threaded, cpuset, 1, 8, 1, False, iothreads=3)  # balanced slices
    assert few.iothreadpin == ((1, "0,1,2"), (2, "3,4,5"), (3, "6,7"))


def test_topology_read_from_sysfs(tmp_path: Path):
    system = tmp_path / "system"
    for node, cpus in (("node0", "0-1,4-5"), ("node1", "2-3,6-7")):
        (system / "node" / node).mkdir(parents=True)
        (system / "node" / node / "cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        topo = system / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        sibling = cpu + 4 if cpu < 4 else cpu - 4
        topo.joinpath("thread_siblings_list").write_text(",".join(map(str, sorted((cpu, sibling)))) + "\n")
    assert hostcpus.read_topology(system) == (((0, 4), (1, 5)), ((2, 6), (3, 7)))


def test_this_hosts_topology_covers_its_cpus():
    topology = hostcpus.read_topology()
    threads = sorted(t for cell in topology for core in cell for t in core)
    assert set(hostcpus.pod_cpuset()) <= set(threads)
    assert len(threads) == len(set(threads)) == os.cpu_count()
