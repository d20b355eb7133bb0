"""A registry's TLS files, trust and identity read apart.

One directory per registry, as containers/image reads it (`--cert-dir`, else
/etc/containers/certs.d/HOST and /etc/docker/certs.d/HOST; pkg/tlsclientconfig/tlsclientconfig.go
SetupCertificates): `*.crt` files are CAs the registry's certificate may chain to, `NAME.cert` with
`NAME.key` a client certificate. They are not the same kind of thing. A CA is public: trusting it on
someone's behalf gives them nothing. A client key is an identity: it belongs to whoever holds the
file, and a process that presents it for another user (root's disk server for a user in its socket
group) lends that user the node's access. So `cas` serves every request, while the identity a
request presents is `held`: the one its options carry inline (a client's own, sent to a server of
another user), else the one in the directory, which is this process's user's own.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

from diskkit.errors import RegistryError
MAX_PEM_BYTES = 1 << 20  # a certificate chain or key file; anything larger is not one


@dataclass(frozen=True)
class Identity:
    """A TLS client certificate (PEM, its chain after it) and its private key (PEM, unencrypted)."""

    cert: bytes
    key: bytes
    origin: str  # where it was read (or who sent it), for messages

    def __repr__(self) -> str:  # never print a key, even in tracebacks
        return f"Identity(origin={self.origin!r})"


def cert_dirs(host: str, cert_dir: str | None) -> list[Path]:
    if cert_dir:
        return [Path(cert_dir)]
    return [Path("/etc/containers/certs.d") / host, Path("/etc/docker/certs.d") / host]


def _present(directory: Path, given: bool) -> bool:
    if directory.is_dir():
        return True
    if given:
        raise RegistryError(directory, "--cert-dir is not a directory")
    return False


def cas(host: str, cert_dir: str | None) -> list[Path]:
    """The private CAs (`*.crt`) for `host`."""
    return [ca for directory in cert_dirs(host, cert_dir) if _present(directory, bool(cert_dir)) for ca in sorted(directory.glob("*.crt"))]


def read_identity(host: str, cert_dir: str | None) -> Identity | None:
    """The first client certificate (`NAME.cert` with its `NAME.key`) in `host`'s directories."""
    for directory in cert_dirs(host, cert_dir):
        if not _present(directory, bool(cert_dir)):
            continue
        for cert in sorted(directory.glob("*.cert")):
            key = cert.with_suffix(".key")
            if not key.exists():
                # tlsclientconfig.go's words: a CA named .cert is the usual mistake
                raise RegistryError(cert, f"client certificate has no matching key {key.name} (CA certificates use the extension .crt)")
            return checked(Identity(_read(cert), _read(key), str(cert)))
    return None


def held(host: str, opts) -> Identity | None:
    """The client identity a request to `host` with these options presents: the one they carry inline
    for it when they carry inline identities at all (a client of another user sent its own, or none),
    else the one in `--cert-dir` or certs.d."""
    if opts.inline_identities is not None:
        return dict(opts.inline_identities).get(host)
    return read_identity(host, opts.cert_dir)


def checked(identity: Identity) -> Identity:
    """`identity`, once OpenSSL takes the pair: a key that does not match its certificate, or an
    encrypted one (OpenSSL would prompt for its passphrase on the terminal, at each connection),
    is refused here in one line rather than in a handshake."""
    with Materialized(identity) as (cert, key):
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=_no_passphrase)
        except (ssl.SSLError, ValueError, OSError) as exc:
            raise RegistryError(identity.origin, f"client certificate and key cannot be used ({getattr(exc, 'reason', None) or exc})") from None
    return identity


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted; give it unencrypted, as containers/image reads it")


class Materialized:
    """An identity as the two file names OpenSSL takes, without writing the key to any directory:
    each is a memfd, named through /proc/self/fd, gone once closed."""

    def __init__(self, identity: Identity):
        self.fds: list[int] = []
        for name, data in (("client-cert", identity.cert), ("client-key", identity.key)):
            fd = os.memfd_create(f"diskkit-{name}", os.MFD_CLOEXEC)
            self.fds.append(fd)
            os.write(fd, data)
        self.paths = tuple(f"/proc/self/fd/{fd}" for fd in self.fds)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> tuple[str, str]:
        return self.paths

    def __exit__(self, *exc) -> None:
        self.close()


def _read(path: Path) -> bytes:
    """A certificate or key file, bounded; a FIFO or device is refused without waiting on it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistryError(path, f"cannot be read ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RegistryError(path, "is not a regular file")
        data = os.read(fd, MAX_PEM_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_PEM_BYTES:
        raise RegistryError(path, f"is larger than {MAX_PEM_BYTES >> 20} MiB; not a certificate or key")
    return data
