"""What the disk server prefetches while a VM boots from a lazy image: the head of the disk at once
(a boot reads its boot sector, loader, kernel and initrd first), then only a read-ahead past the
guest's last read; the rest of the disk waits until the boot is over, as it would otherwise take
the CPU the boot needs (bench/lazy.py measured it). Real registry, real server, qemu-io as the guest."""

from __future__ import annotations

from pathlib import Path

import pytest

from diskkit.layers import lazytoc
from launcher.diskserver.lazydisk import HEAD_PREFETCH, READ_AHEAD
from tests.conftest import run
from tests.lazyhost import (
    build_lazy_image,
    disk_server,
    export_status,
    image_toc,
    open_export,
    random_disk,
    wait_for,
)

MIB = 1 << 20
DISK = 96 * MIB  # 32 MiB of chunks in the head, 16 MiB read ahead, the rest held back


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return random_disk(tmp_path_factory.mktemp("prefetch") / "disk-96m.img", DISK, seed=7)


@pytest.fixture(scope="module")
def image(registry, disk) -> str:
    return build_lazy_image(disk, f"{registry.host}/prefetch/disk:v2")


def present_chunks(cache: Path, export: str, count: int) -> list[int]:
    """The chunks the export's bitmap vouches for (saved once a second, after the data is synced)."""
    bits = (cache / "lazy" / export / "bitmap").read_bytes()
    return [i for i in range(count) if bits[i // 8] >> (i % 8) & 1]


def settled(cache: Path, export: str, count: int, expected: list[int]) -> list[int]:
    """The bitmap once it shows `expected` and the server holds its prefetching back: nothing left it
    may fetch while the guest boots, no fetch in flight (prefetchHeld), so nothing more arrives."""
    wait_for(lambda: present_chunks(cache, export, count) == expected, 60, f"chunks {expected[0]}..{expected[-1]}")
    held = wait_for(lambda: (s := export_status(cache, export))["prefetchHeld"] and s, 60, "prefetching to be held back")
    assert held["present"] == len(expected), held
    return present_chunks(cache, export, count)


def test_a_booting_vm_gets_the_head_and_read_ahead_and_the_rest_waits(tmp_path, registry, image, disk):
    assert DISK > HEAD_PREFETCH + READ_AHEAD + 8 * MIB  # room for chunks that must not arrive
    toc = image_toc(registry, image)
    count = len(toc["members"])
    grid = lazytoc.Grid(toc["size"], toc["chunkSize"], tuple(toc[lazytoc.LENGTHS_FIELD]))  # where each chunk lies (TOC v3)
    head_end = grid.past(0, HEAD_PREFETCH)  # the chunks that hold the first 32 MiB
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = open_export(cache, image)  # a VM is announced: its boot is about to read the head
        export = answer["export"]
        head = list(range(head_end))
        assert settled(cache, export, count, head) == head
        # Announced again, as the run would just before its VM connects: on a loaded machine the head
        # took most of the boot hold (BOOT_HOLD) to settle, and a hold run out rightly lets the rest come.
        open_export(cache, image)

        # The guest reads past the head: that chunk on demand, the chunks of the next READ_AHEAD bytes prefetched, no more.
        at = grid.index(60 * MIB)
        demanded = export_status(cache, export)["stats"]["demand_fetches"]
        run("qemu-io", "-r", "-f", "raw", "-c", f"read {60 * MIB} 512", answer["url"])
        ahead = head + list(range(at, grid.past(at + 1, READ_AHEAD)))
        assert settled(cache, export, count, ahead) == ahead
        assert export_status(cache, export)["stats"]["demand_fetches"] == demanded + 1
        # The head is the disk's own bytes (each chunk's member was checked against the TOC on arrival).
        stored = (cache / "lazy" / export / "disk.img").read_bytes()
        assert stored[: grid.range(head_end - 1)[1]] == disk.read_bytes()[: grid.range(head_end - 1)[1]]
