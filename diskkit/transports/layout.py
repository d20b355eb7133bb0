"""OCI image layouts (`oci:DIR[:TAG]`): a directory with oci-layout, index.json and blobs/sha256/."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator

from diskkit.errors import DiskkitError, NotFound
from diskkit.limits import open_regular
from diskkit.oci.image import Descriptor, canonical_json, check_digest, parse_json
from diskkit.oci.reference import ImageRef
from diskkit.streams import fsutil
from diskkit.streams.directwrite import DirectWriter
from diskkit.transports.base import Destination, Source

REF_NAME = "org.opencontainers.image.ref.name"
OCI_LAYOUT = b'{"imageLayoutVersion":"1.0.0"}'


class DirStore:
    """Files of a layout on disk, never followed outside it."""

    def __init__(self, root: Path):
        self.root = root

    def open(self, rel: str) -> BinaryIO:
        path = self.root / rel
        if path.is_symlink():
            raise DiskkitError(path, "is a symlink; layouts must hold regular files")
        try:
            return open_regular(path)  # a FIFO would hang the read, a device never end it
        except FileNotFoundError:
            raise DiskkitError(path, "missing from the image layout") from None
        except OSError as exc:
            raise DiskkitError(path, f"cannot be read ({exc.strerror})") from None

    def read(self, rel: str) -> bytes:
        with self.open(rel) as f:
            return f.read(64 << 20)


def pick_manifest(index: dict, tag: str | None, where: str) -> Descriptor:
    """The index entry a layout reference names: by ref.name tag, or the only one there is."""
    entries = [Descriptor.from_json(m, where) for m in index.get("manifests") or []]
    if tag:
        named = [e for e in entries if e.annotations.get(REF_NAME) == tag]
        if not named:
            raise NotFound(where, f"no image tagged {tag!r} in the layout")
        return named[-1]
    if len(entries) != 1:
        tags = sorted(e.annotations.get(REF_NAME, "") for e in entries)
        raise DiskkitError(where, f"the layout holds {len(entries)} images; name one with :TAG (tags: {', '.join(t for t in tags if t) or 'none'})")
    return entries[0]


class LayoutReader(Source):
    """An OCI layout read through a store: a directory, or the members of an oci-archive."""

    def __init__(self, store, tag: str | None, where: str):
        self.store = store
        self.tag = tag
        self.where = where

    def top_manifest(self):
        index = parse_json(self.store.read("index.json"), f"{self.where}: index.json")
        desc = pick_manifest(index, self.tag, self.where)
        return self.read_small(desc), desc.media_type, desc

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        return self.store.open(f"blobs/sha256/{check_digest(desc.digest, self.where)}")


class LayoutSource(LayoutReader):
    def __init__(self, ref: ImageRef):
        root = Path(ref.path)
        if not (root / "index.json").is_file():
            raise DiskkitError(ref.path, "is not an OCI image layout (no index.json)")
        super().__init__(DirStore(root), ref.tag, str(ref))


def updated_index(existing: dict | None, entry: Descriptor, tag: str | None) -> dict:
    """index.json with `entry` added, replacing what had the same tag (or, untagged, the same digest)."""
    manifests = list((existing or {}).get("manifests") or [])
    if tag:
        manifests = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) != tag]
    else:
        manifests = [m for m in manifests if m.get("digest") != entry.digest or (m.get("annotations") or {}).get(REF_NAME)]
    manifests.append(entry.to_json())
    out = dict(existing or {})
    out.update({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests})
    return out


class PendingFile:
    """A blob being written under a temporary name in `dest.blobs`, renamed to its digest at commit."""

    def __init__(self, dest: "LayoutDestination", tmp: Path):
        self._dest = dest
        self.tmp = tmp
        self.file = open(tmp, "wb")
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)  # alive: a later push must not reclaim it
        self._out = DirectWriter(tmp, self.file.fileno())  # a blob is hashed on its way in, never read back here
        self.done = False

    def write(self, data) -> None:
        self._out.write(data)

    def commit(self, digest: str, size: int) -> None:
        self._out.close()
        os.fsync(self.file.fileno())
        self.file.close()
        if os.stat(self.tmp).st_size != size:
            raise DiskkitError(self.tmp, "blob size changed while writing")
        final = self._dest.blobs / check_digest(digest, str(self.tmp))
        if final.exists():
            self.tmp.unlink()
        else:
            os.replace(self.tmp, final)
            self._dest.added.append(final)
        self.done = True

    def abort(self) -> None:
        self._out.abort()
        self.file.close()


@contextlib.contextmanager
def pending_blob(dest) -> Iterator[PendingFile]:
    """A PendingFile in `dest.blobs`, removed unless committed: the blob writer of oci: and dir:."""
    pending = PendingFile(dest, dest.blobs / f".tmp-{secrets.token_hex(8)}")
    try:
        yield pending
    finally:
        if not pending.done:
            pending.abort()
            pending.tmp.unlink(missing_ok=True)


class LayoutDestination(Destination):
    compresses_plain_layers = True
    oci_only = True

    """Writes into a new directory (staged under a temporary name, renamed at commit) or adds to an existing layout."""

    def __init__(self, ref: ImageRef, created: int = 0):
        self.ref = ref
        self.final = Path(ref.path)
        self.tag = ref.tag
        self.added: list[Path] = []
        self.entries: list[Descriptor] = []
        if self.final.exists():
            if not self.final.is_dir():
                raise DiskkitError(ref.path, "exists and is not a directory; oci: needs a layout directory")
            if any(self.final.iterdir()) and not (self.final / "oci-layout").is_file():
                raise DiskkitError(ref.path, "is a non-empty directory that is not an OCI layout; refusing to write into it")
            fsutil.check_writable(self.final)
            self.root = self.final
            self.staging = None
        else:
            fsutil.check_writable(self.final.parent)
            self.staging = self.final.parent / f".{self.final.name}.diskkit-{secrets.token_hex(4)}"
            self.root = self.staging
        self.blobs = self.root / "blobs" / "sha256"
        self._alive = None

    def begin(self) -> None:
        if self.staging is None:
            _reclaim(self.blobs.glob(".tmp-*"))
        else:
            _reclaim(self.final.parent.glob(f".{glob.escape(self.final.name)}.diskkit-*"))
        self.blobs.mkdir(parents=True, exist_ok=True)
        if self.staging is not None:
            # Held until commit or abort (or death): tells a later push this staging is no leftover.
            self._alive = os.open(self.staging, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(self._alive, fcntl.LOCK_EX)

    def blob_writer(self, media_type: str) -> contextlib.AbstractContextManager[PendingFile]:
        return pending_blob(self)

    def has_blob(self, desc: Descriptor) -> bool:
        return (self.blobs / check_digest(desc.digest, str(self.root))).is_file()

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        desc = self.put_blob(data, media_type)
        if child:
            return desc
        annotations = {REF_NAME: self.tag} if self.tag else {}
        self.entries.append(Descriptor(media_type, desc.digest, desc.size, annotations, platform))
        return desc

    def commit(self) -> None:
        index_path = self.root / "index.json"
        index = parse_json(index_path.read_bytes(), str(index_path)) if index_path.exists() else None
        for entry in self.entries:
            index = updated_index(index, entry, self.tag)
        if not (self.root / "oci-layout").exists():
            fsutil.write_atomic(self.root / "oci-layout", OCI_LAYOUT)
        fsutil.write_atomic(index_path, self.layout_index if self.layout_index is not None else canonical_json(index))
        if self.staging is not None:
            fsutil.fsync_tree(self.staging)
            try:
                os.rename(self.staging, self.final)
            except OSError as exc:
                self.abort()
                raise DiskkitError(self.final, f"cannot be created ({exc.strerror})") from None
            fsutil.fsync_dir(self.final.parent)
            self._release()

    def abort(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._release()
        else:
            for path in self.added:
                path.unlink(missing_ok=True)

    def _release(self) -> None:
        if self._alive is not None:
            os.close(self._alive)
            self._alive = None


def _reclaim(paths) -> None:
    """Staging a killed push left behind (nobody holds its lock any more) goes before a new one starts."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a push at work
        finally:
            os.close(fd)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

