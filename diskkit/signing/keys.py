"""Sigstore key files, in the formats skopeo's generate-sigstore-key and cosign write and read.

The private key is PKCS#8 DER of an ECDSA P-256 key, sealed with nacl/secretbox under a key derived
by scrypt from the passphrase, the envelope being go-securesystemslib's `encrypted` JSON, in a PEM
block (containers/image signature/sigstore/copied.go, marshalKeyPair and loadPrivateKey). The public
key is a PKIX "PUBLIC KEY" PEM.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import nacl.exceptions
import nacl.secret
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import check_writable, write_atomic

# skopeo 1.9 (containers/image 5.23) reads only the COSIGN label, and containers/image still writes
# it ("a version of cosign that can accept [SIGSTORE] has not yet been released"), so that is what
# we write; both are read.
WRITE_PEM_TYPE = "ENCRYPTED COSIGN PRIVATE KEY"
READ_PEM_TYPES = ("ENCRYPTED COSIGN PRIVATE KEY", "ENCRYPTED SIGSTORE PRIVATE KEY")
# go-securesystemslib's "legacy" scrypt cost, which every version of it (and cosign) accepts.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 32768, 8, 1
SALT_SIZE = 32


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _pem(label: str, der: bytes) -> bytes:
    body = _b64(der)
    lines = [body[i : i + 64] for i in range(0, len(body), 64)]
    return (f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----\n").encode()


def _unpem(data: bytes, where: str) -> tuple[str, bytes]:
    text = data.decode("ascii", "replace").strip()
    first, _, rest = text.partition("\n")
    if not (first.startswith("-----BEGIN ") and first.endswith("-----")):
        raise DiskkitError(where, "not a PEM file")
    label = first[len("-----BEGIN ") : -5]
    body, end, _ = rest.partition(f"-----END {label}-----")
    if not end:
        raise DiskkitError(where, f"PEM block {label} has no END line")
    try:
        return label, base64.b64decode("".join(body.split()), validate=True)
    except ValueError:
        raise DiskkitError(where, "PEM body is not base64") from None


def _box_key(passphrase: bytes, salt: bytes, n: int, r: int, p: int) -> bytes:
    return Scrypt(salt=salt, length=nacl.secret.SecretBox.KEY_SIZE, n=n, r=r, p=p).derive(passphrase)


def generate_key_pair(passphrase: bytes) -> tuple[bytes, bytes]:
    """(private PEM, public PEM) of a fresh ECDSA P-256 key, the only scheme cosign requires."""
    key = ec.generate_private_key(ec.SECP256R1())
    pkcs8 = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    salt = os.urandom(SALT_SIZE)
    sealed = nacl.secret.SecretBox(_box_key(passphrase, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)).encrypt(pkcs8)
    envelope = {
        "kdf": {"name": "scrypt", "params": {"N": SCRYPT_N, "r": SCRYPT_R, "p": SCRYPT_P}, "salt": _b64(salt)},
        "cipher": {"name": "nacl/secretbox", "nonce": _b64(sealed.nonce)},
        "ciphertext": _b64(sealed.ciphertext),
    }
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return _pem(WRITE_PEM_TYPE, json.dumps(envelope).encode()), public


def write_key_files(private_path: Path, public_path: Path, passphrase: bytes) -> None:
    """Both files of a new pair, or neither: each staged, fsynced and renamed; the private one is
    created 0600, so it is never readable by others, even for a moment."""
    private, public = generate_key_pair(passphrase)
    written: list[Path] = []
    try:
        for path, data, mode in ((private_path, private, 0o600), (public_path, public, 0o644)):
            check_writable(path.parent if str(path.parent) else Path("."))
            write_atomic(path, data, mode)  # created with its mode: the private key is never readable by others
            written.append(path)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise


def load_private_key(data: bytes, passphrase: bytes, where: str):
    label, body = _unpem(data, where)
    if label not in READ_PEM_TYPES:
        raise DiskkitError(where, f"unsupported pem type: {label}")
    try:
        envelope = json.loads(body)
        kdf, cipher = envelope["kdf"], envelope["cipher"]
        if kdf["name"] != "scrypt" or cipher["name"] != "nacl/secretbox":
            raise DiskkitError(where, f"unsupported encryption {kdf['name']}/{cipher['name']}")
        params = kdf["params"]
        key = _box_key(passphrase, base64.b64decode(kdf["salt"]), int(params["N"]), int(params["r"]), int(params["p"]))
        nonce, sealed = base64.b64decode(cipher["nonce"]), base64.b64decode(envelope["ciphertext"])
    except (ValueError, KeyError, TypeError):
        raise DiskkitError(where, "not an encrypted sigstore private key") from None
    try:
        pkcs8 = nacl.secret.SecretBox(key).decrypt(sealed, nonce)
    except nacl.exceptions.CryptoError:
        raise DiskkitError(where, "decrypt: wrong passphrase (or a damaged key file)") from None
    return serialization.load_der_private_key(pkcs8, None)


def load_public_key_files(paths) -> list[tuple[str, list]]:
    """Each file's name and the public keys in it; an unreadable file is refused in one line."""
    loaded = []
    for path in paths:
        try:
            loaded.append((str(path), load_public_keys(Path(path).read_bytes(), str(path))))
        except OSError as exc:
            raise DiskkitError(str(path), f"cannot read the public key: {exc.strerror}") from None
    return loaded


def load_public_keys(data: bytes, where: str) -> list:
    """Every PUBLIC KEY block in a file (policy.json's keyPath/keyData may hold several)."""
    keys = []
    text = data.decode("ascii", "replace")
    for block in text.split("-----BEGIN ")[1:]:
        try:
            keys.append(serialization.load_pem_public_key(("-----BEGIN " + block).encode()))
        except ValueError:
            raise DiskkitError(where, "not a PEM public key") from None
    if not keys:
        raise DiskkitError(where, "no public key found in it")
    return keys


def sign(private_key, payload: bytes) -> bytes:
    """The raw signature over the payload with SHA-256 (sigstore's hard-coded hash)."""
    if isinstance(private_key, ec.EllipticCurvePrivateKey):
        return private_key.sign(payload, ec.ECDSA(hashes.SHA256()))
    if isinstance(private_key, rsa.RSAPrivateKey):
        return private_key.sign(payload, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(private_key, ed25519.Ed25519PrivateKey):
        return private_key.sign(payload)
    raise DiskkitError("private key", "unsupported key type")


def verifies(public_key, payload: bytes, signature: bytes) -> bool:
    try:
        if isinstance(public_key, ec.EllipticCurvePublicKey):
            public_key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public_key, rsa.RSAPublicKey):
            public_key.verify(signature, payload, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(public_key, ed25519.Ed25519PublicKey):
            public_key.verify(signature, payload)
        else:
            return False
    except InvalidSignature:
        return False
    return True


def read_passphrase(path: Path | None, prompt: str, confirm: bool = False) -> bytes:
    """The passphrase file's first line (as skopeo reads --passphrase-file), else asked on the terminal."""
    if path is not None:
        try:
            return Path(path).read_bytes().split(b"\n", 1)[0].rstrip(b"\r")
        except OSError as exc:
            raise DiskkitError(path, f"cannot read the passphrase file: {exc.strerror}") from None
    import getpass

    try:
        tty = open("/dev/tty")  # noqa: SIM115
    except OSError:
        raise DiskkitError("passphrase", "no terminal to ask on; give --passphrase-file") from None
    tty.close()
    first = getpass.getpass(prompt)
    if confirm and getpass.getpass("Confirm " + prompt[0].lower() + prompt[1:]) != first:
        raise DiskkitError("passphrase", "the two entries differ")
    return first.encode()
