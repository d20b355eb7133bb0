"""A boot's read traces, published: taken from the node's disk server once the boot is over (it
recorded the reads of each lazily served containerDisk under the run's token), each signed as the
boot-test attestation is and pushed as a referrer of the image it was read from
(diskkit.oci.readtrace is the format; the disk servers that open the image follow it).
"""

from __future__ import annotations

import secrets
import time
from typing import Callable

from diskkit.oci import readtrace
from diskkit.registry.options import RegistryOptions
from launcher.diskserver.client import take_traces
from launcher.node.cache import Cache


def new_token() -> str:
    return secrets.token_hex(16)


def take(cache: Cache, token: str) -> list[dict]:
    """The traces recorded under `token`, one per lazily served containerDisk; recording ends (the
    boot is over: what the guest reads after it, its shutdown say, is no part of its boot)."""
    return take_traces(cache, token)


def publish(attester, traces: list[dict], registry: RegistryOptions | None, say: Callable[[str], None]) -> list[dict]:
    """Attach each trace to its image, signed by `attester` (diskkit.ops.attest.Attester); what was pushed."""
    from diskkit import __version__

    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    pushed = []
    for trace in traces:
        predicate = readtrace.predicate(trace["image"], trace["digest"], trace["path"], trace["size"], trace["reads"],
                                        trace["truncated"], f"launcher {__version__}", stamp)
        done = attester.attach(trace["image"], trace["digest"], predicate, registry or RegistryOptions(), readtrace.PREDICATE_TYPE)
        done = {**done, "reads": len(trace["reads"]), "bytes": sum(length for _, length in trace["reads"])}
        pushed.append(done)
        say(f"read trace of {trace['image']}@{trace['digest'][:19]} ({done['reads']} reads, {done['bytes']} bytes): "
            f"{done['referrer']} ({done['listedBy']})")
    return pushed
