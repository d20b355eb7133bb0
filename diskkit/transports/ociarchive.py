"""`oci-archive:FILE[:TAG]`: an OCI layout packed in one tar file, as skopeo and podman write it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from diskkit.oci.image import Descriptor, canonical_json, check_digest, sha256_digest
from diskkit.oci.reference import ImageRef
from diskkit.streams import fsutil
from diskkit.transports.base import Destination
from diskkit.transports.layout import OCI_LAYOUT, REF_NAME, LayoutReader, updated_index
from diskkit.transports.tarstore import TarStore
from diskkit.transports.tarwriter import TarStreamWriter


class OciArchiveSource(LayoutReader):
    def __init__(self, ref: ImageRef):
        super().__init__(TarStore(Path(ref.path)), ref.tag, str(ref))


class _Pending:
    def __init__(self, tar: TarStreamWriter, names: set[str]):
        self.tar = tar
        self.names = names
        self.done = False

    def write(self, data) -> None:
        self.tar.write(data)

    def commit(self, digest: str, size: int) -> None:
        name = f"blobs/sha256/{check_digest(digest, 'blob')}"
        if name in self.names:
            self.tar.cancel()  # already in the archive: keep one copy
        elif self.tar.end(name) != size:
            raise DiskkitError(name, "blob size changed while writing")
        self.names.add(name)
        self.done = True


class ArchiveWriter(Destination):
    """Shared by both archive formats: a staging file beside the target, renamed into place at commit."""

    def __init__(self, ref: ImageRef, created: int):
        self.ref = ref
        self.final = Path(ref.path)
        self.created = created
        self.names: set[str] = set()

    def begin(self) -> None:
        self.tmp = fsutil.staging_file(self.final)
        try:
            self.file = open(self.tmp, "w+b")
        except OSError as exc:
            raise DiskkitError(self.final, f"cannot be written ({exc.strerror})") from None
        self.tar = TarStreamWriter(self.file, self.created)

    @contextlib.contextmanager
    def blob_writer(self, media_type: str) -> Iterator[_Pending]:
        self.tar.begin()
        pending = _Pending(self.tar, self.names)
        try:
            yield pending
        finally:
            if not pending.done:
                self.tar.cancel()

    def finish(self) -> None:
        self.tar.close()
        self.file.close()
        os.replace(self.tmp, self.final)
        fsutil.fsync_dir(self.final.parent)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class OciArchiveDestination(ArchiveWriter):
    compresses_plain_layers = True
    oci_only = True

    def __init__(self, ref: ImageRef, created: int = 0):
        super().__init__(ref, created)
        self.entries: list[Descriptor] = []

    def begin(self) -> None:
        super().begin()
        self.tar.add_bytes("oci-layout", OCI_LAYOUT)
        self.tar.add_dir("blobs")
        self.tar.add_dir("blobs/sha256")

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        desc = self.put_blob(data, media_type)
        if child:
            return desc
        annotations = {REF_NAME: self.ref.tag} if self.ref.tag else {}
        self.entries.append(Descriptor(media_type, sha256_digest(data), len(data), annotations, platform))
        return desc

    def commit(self) -> None:
        if self.layout_index is not None:
            self.tar.add_bytes("index.json", self.layout_index)
            self.finish()
            return
        index = None
        for entry in self.entries:
            index = updated_index(index, entry, self.ref.tag)
        self.tar.add_bytes("index.json", canonical_json(index))
        self.finish()
