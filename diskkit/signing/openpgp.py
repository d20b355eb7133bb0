"""OpenPGP signing and verification for simple signing, by driving the `gpg` binary.

Chosen over pysequoia and PGPy (measured in the README): signing must use the user's GnuPG
keyring and agent (`GNUPGHOME`, `--sign-by FINGERPRINT`) exactly as skopeo's gpgme build does, and
only gpg can reach keys held by gpg-agent; verification then follows containers/image
signature/mechanism_gpgme.go and mechanism_gpgme_only.go: the policy's keys are imported into a
fresh, throw-away home and a signature counts only when it is the one signature in the message,
good, by a key that was imported, neither expired nor revoked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from diskkit.errors import DiskkitError

STATUS = "[GNUPG:] "
# containers/image iolimits.MaxSignatureBodySize: a payload is a few hundred bytes.
MAX_PAYLOAD = 4 << 20


class InvalidSignature(Exception):
    """The signature does not verify; the message is containers/image's words where it has them."""


def _gpg() -> str:
    path = shutil.which("gpg")
    if path is None:
        raise DiskkitError("gpg", "not found on PATH; GPG simple signing needs GnuPG (apt install gnupg)")
    return path


def _status(stderr: bytes) -> list[list[str]]:
    return [line[len(STATUS):].split(" ") for line in stderr.decode("utf-8", "replace").splitlines() if line.startswith(STATUS)]


def _complaint(stderr: bytes) -> str:
    """gpg's own last human line ("gpg: signing failed: Bad passphrase"), without the prefix."""
    lines = [l for l in stderr.decode("utf-8", "replace").splitlines() if l.startswith("gpg: ")]
    return lines[-1][len("gpg: "):] if lines else "gpg failed"


def sign(payload: bytes, fingerprint: str, passphrase: bytes | None = None, detached: bool = False) -> bytes:
    """A binary OpenPGP signed message holding `payload`, made with key `fingerprint` of the user's
    keyring ($GNUPGHOME honoured). With a passphrase, gpg's loopback pinentry is fed it as gpgme's
    passphrase callback does for skopeo --sign-passphrase-file. `detached`: the signature packet alone,
    over bytes kept elsewhere (a DSSE envelope's pre-authentication encoding)."""
    cmd = [_gpg(), "--batch", "--no-tty", "--status-fd", "2", "--no-armor", "--local-user", fingerprint, "--output", "-",
           "--detach-sign" if detached else "--sign"]
    read_fd = None
    if passphrase is not None:
        read_fd, write_fd = os.pipe()
        os.write(write_fd, passphrase + b"\n")  # far below a pipe's buffer
        os.close(write_fd)
        cmd[1:1] = ["--pinentry-mode", "loopback", "--passphrase-fd", str(read_fd)]
    try:
        done = subprocess.run(cmd, input=payload, capture_output=True, pass_fds=(read_fd,) if read_fd is not None else (), timeout=120)
    finally:
        if read_fd is not None:
            os.close(read_fd)
    if done.returncode != 0 or not any(s[0] == "SIG_CREATED" for s in _status(done.stderr)):
        raise DiskkitError(f"--sign-by {fingerprint}", _complaint(done.stderr))
    return done.stdout


class Keyring:
    """The keys of a policy requirement, imported into a throw-away GnuPG home (binary or armoured
    keyrings, as gpgme imports them). Use as a context manager; `fingerprints` are the primary keys
    imported. With blobs None: the user's own keyring ($GNUPGHOME), as skopeo standalone-verify
    without --public-key-file."""

    def __init__(self, blobs: list[bytes] | None):
        self.home = Path(tempfile.mkdtemp(prefix="diskkit-ephemeral-gpg-")) if blobs is not None else None
        self.fingerprints: list[str] = []
        blobs = blobs or []
        try:
            for blob in blobs:
                done = self._run(["--import"], blob)
                self.fingerprints += [s[2].upper() for s in _status(done.stderr) if s[0] == "IMPORT_OK" and len(s) > 2]
        except BaseException:
            self.close()
            raise

    def _run(self, args: list[str], data: bytes) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_gpg(), *(["--homedir", str(self.home)] if self.home else []), "--batch", "--no-tty", "--no-autostart", "--status-fd", "2", *args],
            input=data, capture_output=True, timeout=60,
        )

    def verify(self, signature: bytes, accepted: list[str] | None = None) -> tuple[bytes, str]:
        """(signed payload, the accepted fingerprint) or InvalidSignature; the key must be one of
        `accepted` (default: those imported), by its own or its primary key's fingerprint."""
        done = self._decrypt(signature)
        return done.stdout, self._judge(done, accepted)

    def verify_detached(self, signature: bytes, data: bytes, accepted: list[str] | None = None) -> str:
        """The accepted fingerprint of a detached signature over `data`, or InvalidSignature."""
        with tempfile.TemporaryDirectory(prefix="diskkit-sig-") as scratch:
            sig = Path(scratch) / "signature"
            sig.write_bytes(signature)
            done = self._run(["--verify", str(sig), "-"], data)
        return self._judge(done, accepted)

    def _judge(self, done: subprocess.CompletedProcess, accepted: list[str] | None) -> str:
        """The one good signature's accepted fingerprint, by gpg's status lines."""
        status = _status(done.stderr)
        codes = [s[0] for s in status]
        if codes.count("NEWSIG") != 1:
            if "NODATA" in codes or not codes.count("NEWSIG"):
                raise InvalidSignature("not a signature: " + _complaint(done.stderr))
            raise InvalidSignature(f"Unexpected GPG signature count {codes.count('NEWSIG')}")
        for bad in ("BADSIG", "ERRSIG", "EXPSIG", "EXPKEYSIG", "REVKEYSIG", "DECRYPTION_FAILED", "BADARMOR"):
            if bad in codes:
                words = {"BADSIG": "Bad signature", "ERRSIG": "No public key" if "NO_PUBKEY" in codes else "cannot check the signature",
                         "EXPSIG": "Signature expired", "EXPKEYSIG": "Key expired", "REVKEYSIG": "Key revoked"}.get(bad, bad)
                raise InvalidSignature(f"Invalid GPG signature: {words}")
        valid = [s for s in status if s[0] == "VALIDSIG"]
        if done.returncode != 0 or "GOODSIG" not in codes or len(valid) != 1:
            raise InvalidSignature("Invalid GPG signature: " + _complaint(done.stderr))
        signing, primary = valid[0][1].upper(), valid[0][-1].upper()
        wanted = [f.upper() for f in (self.fingerprints if accepted is None else accepted)]
        if signing not in wanted and primary not in wanted:
            raise InvalidSignature(f"Signature by key {signing} is not accepted" if signing == primary else f"Signature by key {signing} of {primary} is not accepted")
        return signing if signing in wanted else primary

    def _decrypt(self, signature: bytes) -> subprocess.CompletedProcess:
        """gpg --decrypt with the payload read to at most 4 MiB: a few KiB of compressed packets
        could expand without bound, and memory stays flat whatever a lookaside serves."""
        with tempfile.TemporaryDirectory(prefix="diskkit-sig-") as scratch:
            path = Path(scratch) / "signature"
            path.write_bytes(signature)
            with open(Path(scratch) / "status", "w+b") as err:
                proc = subprocess.Popen(
                    [_gpg(), *(["--homedir", str(self.home)] if self.home else []), "--batch", "--no-tty", "--no-autostart",
                     "--status-fd", "2", "--output", "-", "--decrypt", str(path)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                )
                try:
                    payload = proc.stdout.read(MAX_PAYLOAD + 1)
                    if len(payload) > MAX_PAYLOAD:
                        raise InvalidSignature("signed payload larger than 4 MiB")
                    proc.wait(timeout=60)
                finally:
                    proc.stdout.close()
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                err.seek(0)
                return subprocess.CompletedProcess(proc.args, proc.returncode, payload, err.read())

    def close(self) -> None:
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> "Keyring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify(signature: bytes, keyring: list[bytes]) -> tuple[bytes, str]:
    """(payload, signer's primary fingerprint) of a signature by one of the keys in `keyring`."""
    with Keyring(keyring) as ring:
        if not ring.fingerprints:
            raise InvalidSignature("No public keys imported")
        return ring.verify(signature)
