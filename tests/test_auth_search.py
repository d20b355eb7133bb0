"""Credentials found where `skopeo login` leaves them with no login session (issue 30 item 6), and a 401
that says how to give them; against the real registry with basic auth, diskkit run as another user."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

from tests.test_registry import INSECURE, repo
from tests.vmhost import QEMU_UID


def test_run_containers_uid_auth_json_is_read_without_xdg_runtime_dir(diskkit, auth_registry, qcow2, tmp_path):
    reg = auth_registry
    target = f"{repo(reg)}:v1"
    pushed = diskkit("build", qcow2, "-t", target, INSECURE, "--creds", f"{reg.username}:{reg.password}")
    assert pushed.code == 0, pushed.err
    home = Path(f"/tmp/diskkit-authsearch-{os.getpid()}")
    base = Path("/run/containers")
    made_base = not base.exists()
    per_uid = base / str(QEMU_UID)
    assert not per_uid.exists(), f"{per_uid} exists already; this test writes it"
    try:
        home.mkdir(mode=0o700)
        os.chown(home, QEMU_UID, -1)
        env = {"HOME": str(home), "XDG_RUNTIME_DIR": "", "REGISTRY_AUTH_FILE": ""}
        denied = diskkit("inspect", "--raw", INSECURE, target, user=str(QEMU_UID), env=env)
        assert denied.code == 6  # Exit.AUTH
        assert denied.err.strip().endswith("give credentials with --creds USER:PASS, --authfile FILE or $REGISTRY_AUTH_FILE, or log in with `skopeo login` / `podman login` (read from their auth.json)"), denied.err
        base.mkdir(mode=0o755, exist_ok=True)
        per_uid.mkdir(mode=0o700)
        os.chown(per_uid, QEMU_UID, -1)
        secret = base64.b64encode(f"{reg.username}:{reg.password}".encode()).decode()
        (per_uid / "auth.json").write_text(json.dumps({"auths": {reg.host: {"auth": secret}}}))
        os.chown(per_uid / "auth.json", QEMU_UID, -1)
        found = diskkit("inspect", "--raw", INSECURE, target, user=str(QEMU_UID), env=env)
        assert found.code == 0, found.err
        assert json.loads(found.out)["layers"]
    finally:
        shutil.rmtree(per_uid, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        if made_base:
            base.rmdir()
