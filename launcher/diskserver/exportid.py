"""What an export of the node's disk server is: everything that pins the bytes it serves.

Two opens share an export only when they agree on all of it. A layer digest alone pins nothing
until the whole blob is here and hashed, and a lying registry decides when that is: an image that
names another image's layer digest with its own TOC would otherwise get an export under the
genuine image's name, its chunks checked against its own TOC, and every later VM of the genuine
image would boot the liar's bytes. So the identity holds what each chunk is checked against before
it is served (the TOC's digest and a digest of its per-chunk pins), where the disk lies in the blob,
the diffID, and a digest of the blob's bytes around the chunks (those are only checked with the
blob digest at the end: an export whose head or tail came from someone else would fail there, and
with it every VM on it). An export without per-chunk pins serves bytes nothing has checked yet, so
it is also tied to the registry and repository it reads them from.

The name is a hash of the identity. The control protocol answers it, NBD clients ask for it, and
it names the export's directory in the cache (lazy/<name>), whose source.json records the identity:
a directory whose record differs is never reused. Installed disks are not keyed by this: the blob
digest was checked before they were installed, so (layer digest, member) pins them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ExportId:
    layer: str  # the blob's digest, as the manifest names it
    layer_size: int
    member: str  # the disk's path in the layer
    offset: int  # where the disk starts in the (uncompressed) tar
    size: int
    chunk_size: int
    toc: str | None  # the lazy TOC's digest (the layer's annotation, covered by the manifest digest); None: no TOC
    pins: str | None  # digest of the per-chunk pins every chunk is checked against before it is served; None: none
    diff_id: str | None  # v2: the config's diffID, checked once the disk is complete (v1: the blob is its own)
    around: str  # digest of the blob's bytes before and after the chunks
    source: tuple[str, str] | None  # (registry, repository) the bytes are read from, for an export without pins

    def __post_init__(self) -> None:
        if (self.pins is None) != (self.source is not None):
            raise ValueError("an export is pinned per chunk or tied to its source, never both or neither")

    @property
    def name(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def to_json(self) -> dict:
        out = asdict(self)
        out["source"] = list(self.source) if self.source is not None else None
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "ExportId":
        known = {f.name for f in fields(cls)}
        if set(obj) != known:
            raise ValueError(f"an export identity has exactly the fields {sorted(known)}")
        source = obj["source"]
        return cls(**{**obj, "source": (str(source[0]), str(source[1])) if source is not None else None})


def pins_digest(kind: str, pins: tuple[str, ...]) -> str:
    """One digest of a TOC's per-chunk pins, `kind` naming what they are (chunk sha256s, member blake3s...)."""
    return "sha256:" + hashlib.sha256(f"{kind}\n{chr(10).join(pins)}".encode()).hexdigest()


def around_digest(head: bytes, tail: bytes) -> str:
    """One digest of the blob's bytes before and after the chunks (their lengths follow from the layout)."""
    digest = hashlib.sha256(head)
    digest.update(tail)
    return "sha256:" + digest.hexdigest()
