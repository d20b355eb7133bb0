"""docs/signing.md's node-side recipe, run as written: the block between its node-signing markers, in a
fresh directory holding a disk as `my-disk.qcow2`, with a HOME and a GnuPG home of the test's own and
only the registry's address changed. Then what a node set up otherwise meets (the registries.d keys
are containers/image's, docker/registries_d.go: `lookaside` is read, `lookaside-staging` only written),
and the one line a signing into the built-in store says (builtinDefaultLookasideStorageDir)."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit, run_launcher
from tests.gnupg import new_key
from tests.vmhost import QEMU_UID, qemu_scratch

REPO = Path(__file__).resolve().parent.parent
NOREG = "--tls-verify=false"
NOT_SIGNED = "A signature was required, but no signature exists"


def recipe() -> str:
    found = re.search(r"<!-- node-signing -->\n```sh\n(.*?)```\n<!-- /node-signing -->", (REPO / "docs" / "signing.md").read_text(), re.S)
    assert found, "docs/signing.md has no node-signing block"
    return found.group(1)


@pytest.fixture
def gnupg(tmp_path):
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    new_key(home, "ci <ci@diskkit.test>")
    yield home
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], check=False)


def test_the_node_side_recipe_runs_as_written(tmp_path, registry, gnupg):
    block = recipe()
    assert block.startswith("REGISTRY=127.0.0.1:5000\n")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    make_qcow2(work / "my-disk.qcow2", size="8M", pattern=0x4E)
    env = {**os.environ, "HOME": str(home), "GNUPGHOME": str(gnupg), "DISKKIT_CACHE": str(tmp_path / "cache"), "CI": "true",
           "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    script = "set -e\n" + block.replace("REGISTRY=127.0.0.1:5000", f"REGISTRY={registry.host}", 1)
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    pulled = Path(done.stdout.strip().splitlines()[-1])
    assert pulled.is_relative_to(tmp_path / "cache") and pulled.is_file()
    (signature,) = (work / "sigstore" / "vms").glob("mine@sha256=*/signature-1")
    assert "default lookaside" not in done.stderr  # a registries.d entry placed it

    # The policy holds on that node: an unsigned image is refused before a layer is read.
    unsigned = f"{registry.host}/vms/unsigned:v1"
    assert run_diskkit("build", NOREG, work / "my-disk.qcow2", "-t", unsigned).code == 0
    refused = run_launcher("pull", NOREG, unsigned, env=env)
    assert refused.code == 8 and NOT_SIGNED in refused.err, refused.err
    # A node given only CI's staging entry (what the CI side alone used to show) finds no signature.
    (home / ".config/containers/registries.d/vms.yaml").write_text(f"docker:\n  {registry.host}/vms:\n    lookaside-staging: file://{work / 'sigstore'}\n")
    staging_only = run_launcher("pull", NOREG, "--cache-dir", tmp_path / "other-cache", f"{registry.host}/vms/mine:v1", env=env)
    assert staging_only.code == 8 and NOT_SIGNED in staging_only.err, staging_only.err
    assert signature.is_file()


def test_signing_into_the_built_in_store_says_where_in_one_line(registry):
    # As an unprivileged user, so the built-in store is its HOME's and not the host's /var/lib.
    with qemu_scratch("signing-") as scratch:
        _sign_without_registries_d(scratch, registry)


def _sign_without_registries_d(scratch: Path, registry) -> None:
    user = pwd.getpwuid(QEMU_UID)
    home = scratch / "home"
    gnupg = home / "gnupg"
    gnupg.mkdir(parents=True, mode=0o700)
    for path in (home, gnupg):
        os.chown(path, user.pw_uid, user.pw_gid)
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    env = {**os.environ, "HOME": str(home), "GNUPGHOME": str(gnupg)}
    try:
        made = subprocess.run([*as_user, "gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "", "--quick-gen-key",
                               "ci <ci@diskkit.test>", "ed25519", "sign", "never"], env=env, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        listed = subprocess.run([*as_user, "gpg", "--batch", "--with-colons", "--list-secret-keys"], env=env, capture_output=True, text=True).stdout
        fpr = next(line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:"))
        disk = make_qcow2(home / "disk.qcow2", size="8M", pattern=0x4F)
        os.chown(disk, user.pw_uid, user.pw_gid)
        ref = f"{registry.host}/vms/nowhere:v1"
        built = run_diskkit("build", NOREG, disk, "-t", ref, "--sign-by", fpr, env={"HOME": str(home), "GNUPGHOME": str(gnupg)}, user=str(user.pw_uid))
        assert built.code == 0, built.err
        store = home / ".local/share/containers/sigstore"
        (signature,) = (store / "vms").glob("nowhere@sha256=*/signature-1")
        said = [line for line in built.err.splitlines() if "default lookaside" in line]
        assert said == [f"note: docker://{ref}: signatures stored in the default lookaside {store.as_uri()}/vms/nowhere, as no registries.d"
                        " entry names one for this repository; a node reads them only through a `lookaside:` entry naming where they"
                        " are published (docs/signing.md)"], built.err
    finally:
        subprocess.run([*as_user, "gpgconf", "--homedir", str(gnupg), "--kill", "gpg-agent"], env=env, check=False)
