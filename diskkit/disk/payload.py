"""What a file handed to build, convert or verify really holds: a disk, a compressed or archived disk
(unwrapped as CDI's importer does), or something that is no disk at all (refused with what to do).

CDI's importer (containerized-data-importer pkg/image/filefmt.go, pkg/importer/format-readers.go)
knows gz, xz and zst streams and tar archives by their magic numbers and peels them off before it
looks for a disk format; bzip2, which cloud images are also published in, is peeled the same way.
From a tar it takes the one regular file (pkg/importer/transport.go takes the first non-directory
member under disk/ of a containerDisk layer; an archive of several files is ambiguous here, so refused).
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diskkit.disk.diskheader import probe_format
from diskkit.errors import DiskkitError
from diskkit.streams.compression import decompressing_reader
from diskkit.streams.sparse import SparseWriter

HEAD_BYTES = 4096
SECTOR = 512  # nothing smaller is a disk: qemu and KubeVirt count disks in sectors
CHUNK = 1 << 20
MAX_LAYERS = 4  # a .tar.xz of a .qcow2.gz is already unusual; deeper nesting is refused

COMPRESSIONS = ("xz", "gzip", "zstd", "bzip2")
SUFFIXES = {"xz": (".xz",), "gzip": (".gz", ".tgz"), "zstd": (".zst", ".zstd"), "bzip2": (".bz2", ".tbz2")}
DISK_FORMATS = ("qcow2", "vmdk", "vdi", "vhdx", "vpc")


def classify(head: bytes, size: int) -> str:
    """The kind of a file from its first bytes and size: a compression, "tar", a disk format,
    "raw", or what it is when it is no disk: "elf", "text", "small"."""
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    # "BZh" and the block size, then a block's or the stream end's magic (pi or sqrt(pi) in BCD)
    if head[:3] == b"BZh" and head[3:4] in b"123456789" and head[4:10] in (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90"):
        return "bzip2"
    if head[257:262] == b"ustar":
        return "tar"
    fmt = probe_format(head)
    if fmt != "raw" and head[:21] != b"# Disk DescriptorFile":
        return fmt
    if head.startswith(b"\x7fELF"):
        return "elf"
    if head[:21] == b"# Disk DescriptorFile":
        return "vmdk"  # a text vmdk descriptor; qemu-img and the disk rules judge its extents
    if _is_text(head):
        return "text"
    if size < SECTOR:
        return "small"
    return "raw"


_CONTROL = bytes(c for c in range(32) if c not in b"\t\n\r\f") + b"\x7f"


def _is_text(head: bytes) -> bool:
    """Printable UTF-8 in lines, with no control characters: what a manifest, script or note is, and
    no disk's first sectors are (boot code, partition tables and superblocks hold zeros and binary
    fields). Without a line break it is not called text: a raw disk may hold any bytes, words too."""
    if any(c in head for c in _CONTROL) or b"\n" not in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start >= len(head) - 3  # a character cut by the end of the sample
    return True


def refusal(kind: str, head: bytes, size: int) -> str | None:
    """The one line said about a file that is no disk; None for anything that may be one."""
    if kind == "elf":
        return "is an ELF executable, not a disk image; give a disk (raw, qcow2, vmdk, vdi, vpc or vhdx), and a kernel with --kernel"
    if kind == "small":
        return f"is {size} bytes, less than one {SECTOR}-byte sector: not a disk image; give the disk file itself"
    if kind == "text":
        first = head.split(b"\n", 1)[0][:40].decode("utf-8", "replace")
        return f"is a text file (it starts {first!r}), not a disk image; give the disk file itself (raw, qcow2, vmdk, vdi, vpc or vhdx)"
    return None


def logical_name(name: str, kind: str) -> str:
    """`fedora.qcow2.xz` holds `fedora.qcow2`; a `.tgz` holds a tar."""
    for suffix in SUFFIXES.get(kind, ()):
        if name.endswith(suffix) and len(name) > len(suffix):
            stem = name[: -len(suffix)]
            return stem + ".tar" if suffix.startswith(".t") and suffix != ".tar" else stem
    return name


@dataclass(frozen=True)
class Unwrapped:
    path: Path  # the disk file: the input itself, or one written under the work directory
    name: str  # the disk's own name (the archive member's, or the input's without its compression suffix)
    layers: tuple[str, ...] = ()  # what was peeled off, outermost first: ("xz",), ("gzip", "tar")
    checked: tuple[str, ...] = ()  # "sha256:HEX"... a streamed source's bytes were verified against: all that pins them


def unwrap(source: Path, workdir: Path, note: Callable[[str], None] | None = None) -> Unwrapped:
    """The disk `source` holds: `source` itself, or decompressed / taken out of its archive into
    `workdir` in one pass (sparse, flat memory, one file however deep the wrapping); a file that
    is no disk is refused, naming `source`."""
    size = source.stat().st_size
    with open(source, "rb") as f:
        head = f.read(HEAD_BYTES)
        kind = classify(head, size)
        problem = refusal(kind, head, size)
        if problem:
            raise DiskkitError(source, problem)
        if kind not in COMPRESSIONS and kind != "tar":
            return Unwrapped(source, source.name)
        workdir.mkdir(parents=True, exist_ok=True)
        f.seek(0)
        return unwrap_stream(f, source.name, str(source), workdir / "unwrapped", note)


def _copy_sparse(stream, out: Path) -> int:
    with open(out, "wb") as f:
        writer = SparseWriter(f)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := stream.readinto(view):
            writer.write(view[:n])
        total = f.tell()
        f.truncate(total)
    return total


_EXTENSIONS = {"raw": "img"}


class _Prefixed(io.RawIOBase):
    """A stream whose first bytes were read to classify it, read again from its start."""

    def __init__(self, head: bytes, rest):
        self._head, self._rest = memoryview(head), rest

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buf) or 0


def _read_head(stream) -> bytes:
    head = bytearray()
    while len(head) < HEAD_BYTES:
        piece = stream.read(HEAD_BYTES - len(head))
        if not piece:
            break
        head += piece
    return bytes(head)


def unwrap_stream(stream, name: str, shown: str, out: Path, note: Callable[[str], None] | None = None) -> Unwrapped:
    """The disk a stream (a download, a pipe) holds, written once, sparse, to `out`: compression
    decompressed and a tar's one file taken out as the bytes pass, never an intermediate copy.
    `name` is the stream's file name ("" for a pipe: the disk is then called disk.<format>)."""
    layers: list[str] = []
    checks: list[Callable[[], None]] = []  # run once the disk is out: a tar must hold nothing else
    try:
        while True:
            head = _read_head(stream)
            kind = classify(head, len(head) if len(head) < HEAD_BYTES else HEAD_BYTES)
            stream = _Prefixed(head, stream)
            problem = refusal(kind, head, len(head))
            if problem:
                raise DiskkitError(f"{shown} (unwrapped {'+'.join(layers)}: {name})" if layers else shown, problem)
            if kind in COMPRESSIONS:
                name = logical_name(name, kind)
                stream = decompressing_reader(stream, kind, shown)
            elif kind == "tar":
                tar = tarfile.open(fileobj=stream, mode="r|")
                member = _next_file(tar, shown)
                if member is None:
                    raise DiskkitError(shown, "the archive holds 0 files (none), not one disk; unpack it and give the disk file")
                checks.append(lambda tar=tar, first=member.name: _only_file(tar, first, shown))
                stream = tar.extractfile(member)
                name = os.path.basename(member.name.rstrip("/")) or "disk"
            else:
                if not name:
                    name = f"disk.{_EXTENSIONS.get(kind, kind)}"
                _copy_sparse(stream, out)
                for check in reversed(checks):
                    check()
                if layers and note:
                    note(f"{shown}: {'+'.join(layers)} unwrapped: the disk is {name} ({kind})")
                return Unwrapped(out, name, tuple(layers))
            if len(layers) == MAX_LAYERS:
                raise DiskkitError(shown, f"is wrapped more than {MAX_LAYERS} times ({'+'.join(layers)}+{kind}); unpack it first")
            layers.append(kind)
    except tarfile.TarError as exc:
        raise DiskkitError(shown, f"tar archive cannot be read ({exc}); refused") from None


def _next_file(tar: tarfile.TarFile, shown: str) -> tarfile.TarInfo | None:
    while (member := tar.next()) is not None:
        if member.isfile():
            return member
        if not member.isdir():
            raise DiskkitError(f"{shown}: {member.name}", "the archive holds something other than files and directories; give the disk file itself")
    return None


def _only_file(tar: tarfile.TarFile, first: str, shown: str) -> None:
    names = [first]
    while (member := _next_file(tar, shown)) is not None:
        names.append(member.name)
    if len(names) > 1:
        listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise DiskkitError(shown, f"the archive holds {len(names)} files ({listed}), not one disk; unpack it and give the disk file")
