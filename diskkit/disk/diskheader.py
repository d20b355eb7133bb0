"""Read a disk's format and what matters for safety from its first bytes, without letting qemu open anything.

A backing file or external data file names a host path that qemu would open; refusing such an
image from its header means the named path (`/etc/passwd`, say) is never touched.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"QFI\xfb"
HEADER_BYTES = 64 << 10  # the header, its extensions and the backing name live in the first cluster
_EXT_END = 0
_EXT_DATA_FILE = 0x44415441
_INCOMPAT_DATA_FILE = 1 << 2


@dataclass(frozen=True)
class Qcow2Header:
    version: int
    virtual_size: int
    cluster_bits: int
    backing_file: str | None
    data_file: str | None  # the name, or "" when the feature bit is set without one
    encrypted: bool


def is_qcow2(head: bytes) -> bool:
    return head[:4] == MAGIC


def parse(head: bytes) -> Qcow2Header | None:
    """The header of a qcow2 image from its first bytes; None if it is not qcow2 or too short to tell."""
    if len(head) < 72 or not is_qcow2(head):
        return None
    version, backing_off, backing_len, cluster_bits, size, crypt = struct.unpack_from(">IQIIQI", head, 4)
    backing = None
    if backing_off:
        raw = head[backing_off : backing_off + backing_len]
        backing = raw.decode("utf-8", "replace") if raw else "(beyond the first 64 KiB)"
    incompat = 0
    ext_at = 72
    if version >= 3 and len(head) >= 104:
        incompat = struct.unpack_from(">Q", head, 72)[0]
        ext_at = struct.unpack_from(">I", head, 100)[0]
    data_file = "" if incompat & _INCOMPAT_DATA_FILE else None
    while ext_at + 8 <= len(head):
        kind, length = struct.unpack_from(">II", head, ext_at)
        if kind == _EXT_END:
            break
        if kind == _EXT_DATA_FILE:
            data_file = head[ext_at + 8 : ext_at + 8 + length].decode("utf-8", "replace")
        ext_at += 8 + (length + 7) // 8 * 8
    return Qcow2Header(version, size, cluster_bits, backing, data_file, crypt != 0)


def safety_violations(header: Qcow2Header) -> list[str]:
    found = []
    if header.backing_file is not None:
        found.append(f"expected no backing file, but found {header.backing_file}")
    if header.data_file is not None:
        found.append(f"expected no external data file, but found {header.data_file or '(unnamed)'}")
    if header.encrypted:
        found.append("encrypted qcow2 images cannot be booted by KubeVirt")
    return found


def probe_format(head: bytes) -> str:
    """The format qemu would detect from the first bytes; 'raw' when no known signature is present."""
    if is_qcow2(head):
        return "qcow2"
    if head[:4] == b"KDMV" or head[:21] == b"# Disk DescriptorFile":
        return "vmdk"
    if len(head) >= 0x44 and head[0x40:0x44] == b"\x7f\x10\xda\xbe":
        return "vdi"
    if head[:8] == b"vhdxfile":
        return "vhdx"
    if head[:8] == b"conectix":
        return "vpc"
    return "raw"
