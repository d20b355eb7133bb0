"""Where a lazy export prefetches first: the boot-read trace published beside its image, when a key
the node trusts for the image signed it (diskkit.signing.tracetrust says which trace that is).

Looked for once per export, off the open's path (the head of the disk is on its way meanwhile), only
when keys are in force: with none, the registry is asked nothing. What was found, or why none was
followed, goes into the export's status; a trace that is refused changes nothing but that line.
"""

from __future__ import annotations

import logging

from diskkit.errors import DiskkitError
from diskkit.oci.reference import parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.signing.options import TrustOptions
from diskkit.signing.tracetrust import NoTrace, accepted, keys_in_force

log = logging.getLogger("launcher.traceplan")


def follow(export, shown: str, digest: str, registry: RegistryOptions) -> None:
    """Give `export` (a LazyDisk) the prefetch order of the trace of `shown`@`digest` that the keys
    in force accept, or say in its status why it has none."""
    name = parse_ref(shown).name
    layout = export.layout
    try:
        trusted = keys_in_force(TrustOptions.of(registry), name)
        if not trusted:
            return
        found = accepted(name, digest, layout.member, layout.size, trusted, registry)
    except (NoTrace, DiskkitError) as exc:
        export.follow_trace((), {"refused": exc.line() if isinstance(exc, DiskkitError) else str(exc)})
        log.info("%s: prefetching without a trace: %s", export.name, export.trace["refused"])
        return
    except Exception as exc:  # a bug costs the order, never the export
        log.exception("%s: looking for a trace failed", export.name)
        export.follow_trace((), {"refused": f"internal error: {exc}"})
        return
    trace = found.trace
    export.follow_trace(trace.reads, {"referrer": found.referrer, "signer": found.signer, "reads": len(trace.reads),
                                      "bytes": sum(length for _, length in trace.reads), "truncated": trace.truncated})
    log.info("%s: prefetching in the order of %s (%d reads, signed by %s)", export.name, found.referrer, len(trace.reads), found.signer)
