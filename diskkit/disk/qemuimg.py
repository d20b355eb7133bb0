"""qemu-img as a subprocess, always under CPU-time and address-space limits.

A crafted image can make qemu-img spin or allocate without bound; KubeVirt runs it under
`ulimit -t 10 -v 2000M` for the same reason. Every call here inherits such limits.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError

INFO_CPU_SECONDS = 10
CHECK_CPU_SECONDS = 120
CONVERT_CPU_SECONDS = 6 * 3600
ADDRESS_SPACE = 2000 << 20  # KubeVirt's default for qemu-img info
CONVERT_ADDRESS_SPACE = 4096 << 20
INPUT_FORMATS = ("raw", "qcow2", "vmdk", "vdi", "vpc", "vhdx")
_PROGRESS = re.compile(rb"\((\d{1,3}\.\d\d)/100%\)")


def _binary() -> str:
    found = shutil.which("qemu-img")
    if not found:
        raise DiskkitError("qemu-img", "not found on PATH; install qemu-utils")
    return found


def _limits(cpu: int, memory: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return apply


def start(args: list[str], cpu: int, memory: int = ADDRESS_SPACE) -> subprocess.Popen:
    return subprocess.Popen(
        [_binary(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_limits(cpu, memory),
        env={**os.environ, "LC_ALL": "C"},
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(args: list[str], cpu: int, memory: int = ADDRESS_SPACE) -> subprocess.CompletedProcess:
    return finish(start(args, cpu, memory))


def _failure(path: Path, what: str, proc: subprocess.CompletedProcess) -> DiskkitError:
    if proc.returncode < 0:
        return DiskkitError(path, f"{what} was killed by signal {-proc.returncode} (CPU or memory limit reached); refusing the image")
    message = proc.stderr.decode(errors="replace").strip().splitlines()
    detail = message[-1] if message else f"exit code {proc.returncode}"
    return DiskkitError(path, f"{what} failed: {detail.removeprefix('qemu-img: ')}")


@dataclass(frozen=True)
class DiskInfo:
    path: Path
    format: str
    virtual_size: int
    actual_size: int
    backing_file: str | None
    data_file: str | None
    raw: dict

    @classmethod
    def from_json(cls, path: Path, obj: dict) -> "DiskInfo":
        specific = (obj.get("format-specific") or {}).get("data") or {}
        return cls(
            path=path,
            format=obj.get("format", ""),
            virtual_size=int(obj.get("virtual-size", 0)),
            actual_size=int(obj.get("actual-size", 0)),
            backing_file=obj.get("full-backing-filename") or obj.get("backing-filename"),
            data_file=specific.get("data-file"),
            raw=obj,
        )


def info(path: Path, fmt: str | None = None) -> DiskInfo:
    """`qemu-img info --output=json`, with no backing chain opened (a backing file is a finding, not an input)."""
    args = ["info", "--output=json"]
    if fmt:
        args += ["-f", fmt]
    proc = run([*args, "--", str(path)], INFO_CPU_SECONDS)
    if proc.returncode != 0:
        raise _failure(path, "qemu-img info", proc)
    try:
        obj = json.loads(proc.stdout)
    except ValueError:
        raise DiskkitError(path, "qemu-img info printed no JSON") from None
    return DiskInfo.from_json(path, obj)


def start_check(path: Path, fmt: str) -> subprocess.Popen:
    """`qemu-img check` started, for check() to judge: it can run beside `qemu-img info`."""
    return start(["check", "-f", fmt, "--output=json", "--", str(path)], CHECK_CPU_SECONDS)


def check(path: Path, fmt: str, started: subprocess.Popen | None = None) -> None:
    """`qemu-img check`: refuses truncated or corrupt qcow2 metadata (leaks are harmless and allowed)."""
    proc = finish(started or start_check(path, fmt))
    # Exit 3 means leaked clusters only: wasted space, no corruption.
    if proc.returncode in (0, 3):
        return
    if proc.returncode < 0:
        raise _failure(path, "qemu-img check", proc)
    try:
        result = json.loads(proc.stdout)
        detail = f"{result.get('corruptions', '?')} corruptions, {result.get('check-errors', 0)} check errors"
    except ValueError:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        detail = lines[-1].removeprefix("qemu-img: ") if lines else f"exit code {proc.returncode}"
    raise DiskkitError(path, f"qcow2 image is corrupt or truncated (qemu-img check: {detail})")


def convert(
    src: Path,
    dst: Path,
    src_format: str,
    out_format: str,
    compress: bool = False,
    progress: Callable[[float], None] | None = None,
) -> None:
    """`qemu-img convert -p`, reporting percent done from its progress output as CDI parses it."""
    args = [_binary(), "convert", "-p", "-f", src_format, "-O", out_format]
    if compress:
        if out_format != "qcow2":
            raise DiskkitError(dst, "-c (compression) needs -O qcow2")
        args.append("-c")
    if out_format == "raw":
        args += ["-S", "4k"]  # keep zero runs as holes
    args += ["--", str(src), str(dst)]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_limits(CONVERT_CPU_SECONDS, CONVERT_ADDRESS_SPACE),
        env={**os.environ, "LC_ALL": "C"},
    )
    assert proc.stdout is not None
    pending = b""
    while chunk := proc.stdout.read1(4096):
        pending += chunk
        found = _PROGRESS.findall(pending)
        if found and progress:
            progress(float(found[-1]))
        pending = pending[-32:]
    stderr = proc.stderr.read() if proc.stderr else b""
    if proc.wait() != 0:
        dst.unlink(missing_ok=True)
        raise _failure(src, "qemu-img convert", subprocess.CompletedProcess(args, proc.returncode, b"", stderr))


def _create(final: Path, options: list[str], size: int | None = None, mode: int = 0o640) -> None:
    """`qemu-img create` under a temporary name, renamed when complete: never a half-made image."""
    tmp = final.with_name(f".{final.name}.tmp")
    proc = run(["create", "-q", *options, "--", str(tmp), *([str(size)] if size is not None else [])], INFO_CPU_SECONDS)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise _failure(final, "qemu-img create", proc)
    os.chmod(tmp, mode)
    tmp.replace(final)


def create_overlay(base: Path | str, base_format: str, overlay: Path, size: int | None = None) -> None:
    """A copy-on-write qcow2 layer over a read-only base (`qemu-img create -f qcow2 -b BASE -F FMT`).

    With `size` the base is not opened (-u): for a base qemu reaches over the network (an NBD URL)."""
    _create(overlay, ["-f", "qcow2", "-b", str(base), "-F", base_format, *(["-u"] if size is not None else [])], size)


def create_image(path: Path, fmt: str, size: int) -> None:
    """An empty disk of `size` bytes (`qemu-img create -f FMT PATH SIZE`)."""
    _create(path, ["-f", fmt], size)
