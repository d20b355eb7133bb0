"""The launcher's image, built once per set of inputs, and a private rootful podman to play pods in.

The image archive is cached outside the clone ($DISKKIT_TEST_CACHE, default /var/cache/diskkit-test)
under the hash of everything that goes into it, so a CI run rebuilds it only when one of those
changed. podman keeps its storage, secrets, volumes and runtime state under the test's directory;
nothing of the host's container storage is touched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests import leftovers

REPO = Path(__file__).resolve().parent.parent
BUILD_SH = REPO / "images" / "launcher" / "build.sh"
CACHE = Path(os.environ.get("DISKKIT_TEST_CACHE", "/var/cache/diskkit-test"))


def version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("no version in pyproject.toml")


def image_tag() -> str:
    return f"localhost/diskkit-launcher:{version()}"


def _inputs() -> list[Path]:
    files = [REPO / "pyproject.toml", REPO / "README.md", *sorted((REPO / "images" / "launcher").iterdir())]
    for package in ("diskkit", "launcher"):
        files += sorted(p for p in (REPO / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files


def inputs_hash() -> str:
    digest = hashlib.sha256()
    for path in _inputs():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def launcher_image() -> Path:
    """The image archive for the current inputs, built by images/launcher/build.sh if missing."""
    archive = CACHE / f"launcher-image-{inputs_hash()}.tar"
    if archive.is_file():
        return archive
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".launcher-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs build once
        if not archive.is_file():
            # The deps stage (Debian packages, Python dependencies: nearly all of the build) is kept
            # in the same directory under the hash of its own inputs, so a change of source alone
            # rebuilds only the source layer.
            proc = subprocess.run(["bash", str(BUILD_SH), str(archive)], capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "DEPS_CACHE": str(CACHE)})
            assert proc.returncode == 0, f"{BUILD_SH} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            for old in CACHE.glob("launcher-image-*.tar"):
                if old != archive:
                    old.unlink(missing_ok=True)  # one image per machine is enough (build.sh prunes its deps the same way)
    return archive


class Podman:
    """Rootful podman with storage and state private to `root`."""

    def __init__(self, root: Path, sysctls: dict[str, str] | None = None):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # slirp4netns's API socket lives in tmp_dir, under a name of 68 characters: a socket path has
        # 107 at most, more than a pytest directory leaves.
        self.tmp = Path(tempfile.mkdtemp(prefix="diskkit-e2e-pm-", dir="/tmp"))
        leftovers.scratch_made(self.tmp)
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "vfs"\ngraphroot = "{root}/storage"\nrunroot = "{root}/run"\n')
        # containers.conf's own default sysctl (ping_group_range) kept beside the ones asked for.
        defaults = {"net.ipv4.ping_group_range": "0 0", **(sysctls or {})}
        # runc cannot raise rlimits here; no systemd to run cgroups or healthcheck timers.
        (root / "containers.conf").write_text(
            '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'
            f'default_sysctls = {json.dumps([f"{k}={v}" for k, v in defaults.items()])}\n'
            f'[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\nevents_logfile_path = "{root}/events.log"\n'
            f'tmp_dir = "{self.tmp}"\n')
        self.env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
                    "CONTAINERS_CONF": str(root / "containers.conf")}

    def __call__(self, *args: str | os.PathLike, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run(["podman", *map(str, args)], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"podman {' '.join(map(str, args))}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def out(self, *args: str | os.PathLike) -> str:
        return self(*args).stdout.strip()

    def close(self) -> None:
        """The short temporary directory goes, with any process still naming it."""
        leftovers.remove_scratch(self.tmp)
