"""Credentials found where `skopeo login` leaves them with no login session (issue 30 item 6), and a 401
that says how to give them; against the real registry with basic auth, diskkit run as another user.

The host's /run is never used: each run of diskkit sees a /run of its own (a tmpfs in a private mount
namespace) holding only the /run/containers the test lays out, so what root's podman or skopeo did to
the host's /run/containers (made it 0700) changes nothing here, and the 0700 case is tested on purpose."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import Result
from tests.test_registry import INSECURE, repo
from tests.vmhost import QEMU_UID

# $1: the mode of /run/containers, $2: the directory shown as /run/containers/107 ("" for none).
PRIVATE_RUN = """\
set -e
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -m "$1" /run/containers
if [ -n "$2" ]; then mkdir /run/containers/107 && mount --bind "$2" /run/containers/107; fi
shift 2
exec "$@"
"""


def diskkit_with_run(mode: str, per_uid: Path | None, home: Path, *args: str) -> Result:
    inner = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", sys.executable, "-m", "diskkit", *args]
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", PRIVATE_RUN, "sh", mode, str(per_uid or ""), *inner]
    env = {**os.environ, "CI": "true", "HOME": str(home), "XDG_RUNTIME_DIR": "", "REGISTRY_AUTH_FILE": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def pushed(diskkit, auth_registry, qcow2) -> str:
    target = f"{repo(auth_registry)}:v1"
    result = diskkit("build", qcow2, "-t", target, INSECURE, "--creds", f"{auth_registry.username}:{auth_registry.password}")
    assert result.code == 0, result.err
    return target


@pytest.fixture
def qemu_home() -> Path:
    with tempfile.TemporaryDirectory(prefix="authsearch-") as scratch:  # pytest's own are root's alone
        os.chmod(scratch, 0o755)
        home = Path(scratch) / "home"
        home.mkdir(mode=0o700)
        os.chown(home, QEMU_UID, -1)
        yield home


def per_uid_auth(tmp_path: Path, reg) -> Path:
    per_uid = tmp_path / "run-containers-107"
    per_uid.mkdir(mode=0o700)
    secret = base64.b64encode(f"{reg.username}:{reg.password}".encode()).decode()
    (per_uid / "auth.json").write_text(json.dumps({"auths": {reg.host: {"auth": secret}}}))
    for path in (per_uid, per_uid / "auth.json"):
        os.chown(path, QEMU_UID, -1)
    return per_uid


def test_run_containers_uid_auth_json_is_read_without_xdg_runtime_dir(auth_registry, pushed, qemu_home, tmp_path):
    denied = diskkit_with_run("0755", None, qemu_home, "inspect", "--raw", INSECURE, pushed)
    assert denied.code == 6  # Exit.AUTH
    assert denied.err.strip().endswith("give credentials with --creds USER:PASS, --authfile FILE or $REGISTRY_AUTH_FILE, or log in with `skopeo login` / `podman login` (read from their auth.json)"), denied.err
    found = diskkit_with_run("0755", per_uid_auth(tmp_path, auth_registry), qemu_home, "inspect", "--raw", INSECURE, pushed)
    assert found.code == 0, found.err
    assert json.loads(found.out)["layers"]


def test_an_auth_json_behind_a_run_containers_root_closed_says_why_it_was_not_read(auth_registry, pushed, qemu_home, tmp_path):
    # Root's podman or skopeo (containers/storage, containers/image) makes /run/containers 0700: the
    # qemu user's own /run/containers/107/auth.json is then out of its reach, and the 401 says so.
    denied = diskkit_with_run("0700", per_uid_auth(tmp_path, auth_registry), qemu_home, "inspect", "--raw", INSECURE, pushed)
    assert denied.code == 6, denied.err
    assert len(denied.err.strip().splitlines()) == 1, denied.err
    assert (f"/run/containers/{QEMU_UID}/auth.json cannot be read: /run/containers is not searchable by uid {QEMU_UID} "
            "(mode 0700, owner uid 0)") in denied.err, denied.err
