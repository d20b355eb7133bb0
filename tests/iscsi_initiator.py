"""Another initiator on the host: a libiscsi session of its own (libiscsi7, the library qemu's iSCSI driver
uses; through ctypes, no headers needed) to a tests.tgt target, to see a LUN's SCSI persistent reservation
as any other node of a cluster sees it. The host has no SCSI stack of its own to run sg_persist on.

    with session(target, "iqn.2026-11.io.diskkit:other") as s:
        s.read_reservation()   # (holder's key, type) or None
        s.read_keys()          # the registered keys
        s.write_status()       # SCSI status of a WRITE(10) of sector 0: 0 GOOD, 0x18 RESERVATION CONFLICT
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

RESERVATION_CONFLICT = 0x18
_SESSION_NORMAL = 2
_HEADER_DIGEST_NONE = 0
_READ_KEYS, _READ_RESERVATION = 0, 1


class _ReadKeys(ctypes.Structure):  # libiscsi's struct scsi_persistent_reserve_in_read_keys (scsi-lowlevel.h)
    _fields_ = [("prgeneration", ctypes.c_uint32), ("additional_length", ctypes.c_uint32), ("num_keys", ctypes.c_int)]


class _ReadReservation(ctypes.Structure):  # struct scsi_persistent_reserve_in_read_reservation
    _fields_ = [("prgeneration", ctypes.c_uint32), ("additional_length", ctypes.c_uint32), ("reserved", ctypes.c_int),
                ("reservation_key", ctypes.c_uint64), ("pr_scope", ctypes.c_ubyte), ("pr_type", ctypes.c_ubyte)]


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libiscsi.so.7")
    p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    for name, res, args in (
        ("iscsi_create_context", p, [s]), ("iscsi_set_targetname", i, [p, s]), ("iscsi_set_session_type", i, [p, i]),
        ("iscsi_set_header_digest", i, [p, i]), ("iscsi_full_connect_sync", i, [p, s, i]), ("iscsi_get_error", s, [p]),
        ("iscsi_logout_sync", i, [p]), ("iscsi_destroy_context", i, [p]),
        ("iscsi_persistent_reserve_in_sync", p, [p, i, i, ctypes.c_uint16]), ("scsi_datain_unmarshall", p, [p]),
        ("iscsi_write10_sync", p, [p, i, ctypes.c_uint32, s, ctypes.c_uint32, i, i, i, i, i, i]),
        ("scsi_free_scsi_task", None, [p]),
    ):
        getattr(lib, name).restype, getattr(lib, name).argtypes = res, args
    return lib


class Session:
    def __init__(self, lib: ctypes.CDLL, ctx: int, lun: int):
        self._lib, self._ctx, self._lun = lib, ctx, lun

    def _task(self, task: int | None) -> int:
        if not task:
            raise RuntimeError(f"iSCSI: {self._lib.iscsi_get_error(self._ctx).decode()}")
        return task

    @staticmethod
    def _status(task: int) -> int:
        return ctypes.cast(task, ctypes.POINTER(ctypes.c_int))[0]  # struct scsi_task starts with its status

    def read_keys(self) -> list[int]:
        task = self._task(self._lib.iscsi_persistent_reserve_in_sync(self._ctx, self._lun, _READ_KEYS, 512))
        try:
            if self._status(task) != 0:
                raise RuntimeError(f"PERSISTENT RESERVE IN READ KEYS: SCSI status {self._status(task):#x}")
            data = self._lib.scsi_datain_unmarshall(task)
            head = ctypes.cast(data, ctypes.POINTER(_ReadKeys))[0]
            keys = ctypes.cast(data + 16, ctypes.POINTER(ctypes.c_uint64))  # uint64_t keys[] after the aligned head
            return [keys[k] for k in range(min(head.num_keys, 64))]
        finally:
            self._lib.scsi_free_scsi_task(task)

    def read_reservation(self) -> tuple[int, int] | None:
        task = self._task(self._lib.iscsi_persistent_reserve_in_sync(self._ctx, self._lun, _READ_RESERVATION, 512))
        try:
            if self._status(task) != 0:
                raise RuntimeError(f"PERSISTENT RESERVE IN READ RESERVATION: SCSI status {self._status(task):#x}")
            r = ctypes.cast(self._lib.scsi_datain_unmarshall(task), ctypes.POINTER(_ReadReservation))[0]
            # libiscsi sets `reserved` when the target returned a reservation descriptor (additional_length stays 0)
            return (r.reservation_key, r.pr_type) if r.reserved else None
        finally:
            self._lib.scsi_free_scsi_task(task)

    def write_status(self) -> int:
        task = self._task(self._lib.iscsi_write10_sync(self._ctx, self._lun, 0, b"\0" * 512, 512, 512, 0, 0, 0, 0, 0))
        try:
            return self._status(task)
        finally:
            self._lib.scsi_free_scsi_task(task)


@contextmanager
def session(target, initiator: str):
    """A logged-in session of initiator `initiator` to `target` (a tests.tgt.RunningTarget without CHAP)."""
    lib = _lib()
    ctx = lib.iscsi_create_context(initiator.encode())
    if not ctx:
        raise RuntimeError("iscsi_create_context failed")
    try:
        lib.iscsi_set_targetname(ctx, target.iqn.encode())
        lib.iscsi_set_session_type(ctx, _SESSION_NORMAL)
        lib.iscsi_set_header_digest(ctx, _HEADER_DIGEST_NONE)
        if lib.iscsi_full_connect_sync(ctx, target.portal.encode(), target.lun) != 0:
            raise RuntimeError(f"iSCSI login to {target.url}: {lib.iscsi_get_error(ctx).decode()}")
        yield Session(lib, ctx, target.lun)
        lib.iscsi_logout_sync(ctx)
    finally:
        lib.iscsi_destroy_context(ctx)
