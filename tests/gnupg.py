"""A private GnuPG home for tests: keys made in it, and GNUPGHOME pointing at it while a test module
signs (diskkit, skopeo and podman all sign from GNUPGHOME), its agent ended afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def gpg(home: Path, *args: str, data: bytes | None = None) -> bytes:
    proc = subprocess.run(["gpg", "--homedir", str(home), "--batch", "--no-tty", *args], input=data, capture_output=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout


def new_key(home: Path, uid: str, passphrase: str = "") -> str:
    gpg(home, "--pinentry-mode", "loopback", "--passphrase", passphrase, "--quick-gen-key", uid, "ed25519", "sign", "never")
    lines = gpg(home, "--with-colons", "--list-secret-keys", uid).decode().splitlines()
    return next(l.split(":")[9] for l in lines if l.startswith("fpr:"))


@contextlib.contextmanager
def gnupg_home(home: Path):
    old = os.environ.get("GNUPGHOME")
    os.environ["GNUPGHOME"] = str(home)
    try:
        yield
    finally:
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], check=False)
        if old is None:
            os.environ.pop("GNUPGHOME", None)
        else:
            os.environ["GNUPGHOME"] = old
