"""An unchanged URL build pinned by a checksum, answered before any byte of its source is fetched.

A layer record (diskkit.ops.buildrecord) is found only after the download: its key holds what the
downloaded disk turned out to be. A checksum names a URL's bytes before they are fetched, so a second
record, keyed by every URL as shown with the checksums its bytes must hash to, every build option
and the destination, remembers the image that build wrote there. Like the layer record it is a hint:
it is used only when the destination's tag still resolves to the recorded manifest (its bytes hashed
here, so a tag moved elsewhere, a deleted tag or an unreadable destination means a download).

HTTP validators (ETag, Last-Modified, If-None-Match) are not used: servers and mirrors give weak or
per-mirror ones; the checksum is what pins the bytes. Without a checksum nothing pins them, and every
build downloads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.oci.image import sha256_digest
from diskkit.ops import buildrecord
from diskkit.registry.options import RegistryOptions
from diskkit.source import checksum, urls

# Destinations read back as they were written; archives are rewritten whole and engines re-number images.
TRANSPORTS = ("docker", "oci")
# Options that are not the image's content (or are pinned apart: local files by their inode and times).
_NOT_CONTENT = ("source", "dest", "also", "checksum", "checksum_file", "kernel", "initrd", "platforms")


def key(opts, dest_ref, expected: list[list[checksum.Expected]]) -> tuple[str, bool] | None:
    """The record's name for this build and whether it may be written (buildrecord.key's rule for the
    kernel and initrd files); None when the build cannot be answered from a record: a source that is
    not a URL or has no checksum, or a destination that cannot be read back by its tag."""
    sources = [(str(plat), src) for plat, src in opts.platforms] or [(str(opts.platform), opts.source)]
    if not all(isinstance(src, str) and urls.is_url(src) for _, src in sources) or not all(expected):
        return None
    tag = dest_ref.name.tag if dest_ref.transport == "docker" else dest_ref.tag
    if dest_ref.transport not in TRANSPORTS or not tag or (dest_ref.name is not None and dest_ref.name.digest):
        return None
    options = {k: v for k, v in dataclasses.asdict(opts).items() if k not in _NOT_CONTENT}
    settings = json.loads(json.dumps({"image": options, "destination": str(dest_ref)}, sort_keys=True, default=str))
    files = [(a[0], Path(a[1])) for a in (opts.kernel, opts.initrd) if a]
    streamed = [(where, urls.shown(src), tuple(str(e) for e in sums)) for (where, src), sums in zip(sources, expected)]
    return buildrecord.key(files, settings, streamed)


def held(name: str, dest_ref, registry: RegistryOptions | None) -> dict | None:
    """The build's recorded result (BuildResult.to_json's object) when the destination's tag still
    names the manifest recorded under `name`; None when there is no record or the tag does not."""
    from diskkit.transports import open_source

    record = buildrecord.read(name)
    result = record.get("image") if record else None
    if not isinstance(result, dict) or not isinstance(result.get("digest"), str) or not buildrecord.DIGEST.match(result["digest"]):
        return None
    try:
        with open_source(dest_ref, registry or RegistryOptions()) as source:
            data, _, _ = source.top_manifest()
    except (DiskkitError, OSError, ValueError):
        return None  # a missing tag or repository, an unreachable destination: built as if never built
    return result if sha256_digest(data) == result["digest"] else None


def store(name: str, result: dict) -> str | None:
    """Remember the image a build wrote (BuildResult.to_json's object); the reason it could not be, or None."""
    return buildrecord.write(name, {"image": result})
