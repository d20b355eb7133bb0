"""Real CNCF distribution registries (``docker-registry serve``) started by the tests.

``start_registry`` runs one on a free loopback port with filesystem storage, optionally behind TLS
(a throw-away CA generated here) and with htpasswd or Docker-token authentication (a small token
issuer runs in a daemon thread of the test process).  The pytest fixtures at the bottom give one
registry of each kind per session.
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import http.server
import ipaddress
import json
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

REGISTRY_BINARY = "docker-registry"
USERNAME = "diskkit"
TOKEN_SERVICE = "diskkit-test"
TOKEN_ISSUER = "diskkit-test-issuer"
READY_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- certificates -------------------------------------------------------------------------------

def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost signed by it: (ca.crt, server.crt, server.key)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name("diskkit test CA"))
        .issuer_name(_name("diskkit test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = directory / "ca.crt", directory.parent / "server.crt", directory.parent / "server.key"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)
    return ca_path, cert_path, key_path


@dataclass(frozen=True)
class ClientCA:
    """The CA a registry with `http.tls.clientcas` checks client certificates against."""

    key: object
    cert: x509.Certificate
    path: Path

    def issue(self, cert_dir: Path, name: str, ca: Path | None = None) -> Path:
        """A certs.d-style directory for one client: `<name>.cert` and `<name>.key` signed by this CA,
        with `ca` (the registry's server CA) beside them as ca.crt; the directory."""
        cert_dir.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        (cert_dir / f"{name}.cert").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = cert_dir / f"{name}.key"
        key_path.write_bytes(_pem_key(key))
        key_path.chmod(0o600)
        if ca is not None:
            shutil.copyfile(ca, cert_dir / "ca.crt")
        return cert_dir


def make_client_ca(path: Path) -> ClientCA:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _validity(x509.CertificateBuilder())
        .subject_name(_name("diskkit test client CA"))
        .issuer_name(_name("diskkit test client CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ClientCA(key, cert, path)


# --- token issuer -------------------------------------------------------------------------------

def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenIssuer:
    """Docker token-spec issuer: GET /token?service=..&scope=.. with optional Basic auth.

    Valid credentials get every requested action, anonymous requests only "pull", wrong credentials 401.
    """

    def __init__(self, workdir: Path, username: str, password: str, ttl: int, port: int | None = None):
        self.username, self.password, self.ttl = username, password, ttl
        self.requests: list[dict] = []
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.cert = (
            _validity(x509.CertificateBuilder())
            .subject_name(_name(TOKEN_ISSUER))
            .issuer_name(_name(TOKEN_ISSUER))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = workdir / "token-rootcert.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()
        self.port = port or free_port()
        self._server: http.server.ThreadingHTTPServer | None = None
        self.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def start(self) -> None:
        if self._server is not None:
            return
        issuer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = 30

            def log_message(self, *args):  # keep the test output clean
                pass

            def do_GET(self):
                issuer._handle(self)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _reply(self, h: http.server.BaseHTTPRequestHandler, status: int, body: dict, extra: dict | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        if url.path != "/token":
            return self._reply(h, 404, {"errors": [{"code": "NOT_FOUND"}]})
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        service = (query.get("service") or [""])[0]
        scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
        user, password = None, None
        header = h.headers.get("Authorization", "")
        if header.lower().startswith("basic "):
            try:
                user, _, password = base64.b64decode(header[6:].strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                user, password = "", None
        self.requests.append({"user": user, "scope": scopes, "service": service})
        if user is not None and (user != self.username or password != self.password):
            return self._reply(
                h, 401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]},
                {"WWW-Authenticate": f'Basic realm="{self.realm}"'},
            )
        access = []
        for scope in scopes:
            # type:name:actions — the name may itself contain ":" (a registry host with a port never appears here).
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            wanted = [a for a in actions.split(",") if a]
            granted = wanted if user is not None else [a for a in wanted if a == "pull"]
            access.append({"type": kind, "name": name, "actions": granted})
        token = self.issue(user or "", service, access)
        now = datetime.datetime.now(datetime.timezone.utc)
        self._reply(h, 200, {
            "token": token, "access_token": token, "expires_in": self.ttl,
            "issued_at": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        })

    def issue(self, subject: str, audience: str, access: list[dict], ttl: int | None = None) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {
            "iss": TOKEN_ISSUER, "sub": subject, "aud": audience, "exp": now + (self.ttl if ttl is None else ttl),
            "nbf": now - 1, "iat": now, "jti": secrets.token_hex(12), "access": access,
        }
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"


def decode_jwt_claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


# --- the registry -------------------------------------------------------------------------------

def die_with_parent(sig: int = signal.SIGTERM):
    """A preexec_fn: the child gets `sig` when the test process dies, so a crashed run leaves no server behind."""

    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return arm


@dataclass
class RunningRegistry:
    host: str
    root: Path
    auth: str
    tls: bool
    ca_dir: Path | None
    username: str | None
    password: str | None
    token_requests: list[dict] = field(default_factory=list)
    config: Path | None = None
    log_path: Path | None = None
    issuer: TokenIssuer | None = field(default=None, repr=False)
    # mutual TLS (`http.tls.clientcas`): the CA client certificates must be signed by, and a client
    # directory of the test's own for the readiness probe
    client_ca: ClientCA | None = field(default=None, repr=False)
    probe_dir: Path | None = None
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _log_file: object = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def verify(self) -> str | bool:
        """What to pass as ``requests``' ``verify=`` for this registry."""
        return str(self.ca_dir / "ca.crt") if self.ca_dir else True

    def url(self, path: str = "/v2/") -> str:
        return f"{self.scheme}://{self.host}{path}"

    def blob_data_path(self, digest: str) -> Path:
        algo, _, hexpart = digest.partition(":")
        if algo != "sha256" or len(hexpart) != 64:
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self.root / "docker/registry/v2/blobs/sha256" / hexpart[:2] / hexpart / "data"

    def auth_file(self, path: Path) -> Path:
        auths = {}
        if self.username is not None:
            auths[self.host] = {"auth": base64.b64encode(f"{self.username}:{self.password}".encode()).decode()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"auths": auths}))
        return path

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def _start(self) -> None:
        if self.issuer is not None:
            self.issuer.start()
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [REGISTRY_BINARY, "serve", str(self.config)],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
        )
        deadline = time.monotonic() + READY_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                self._stop_process()
                raise RuntimeError(f"docker-registry exited with {code}:\n{self.log_text()}")
            try:
                cert = (str(self.probe_dir / "probe.cert"), str(self.probe_dir / "probe.key")) if self.probe_dir else None
                r = requests.get(self.url(), verify=self.verify, cert=cert, timeout=1)
                if r.status_code in (200, 401):
                    return
                last = f"HTTP {r.status_code}"
            except requests.RequestException as e:
                last = repr(e)
            time.sleep(0.05)
        self._stop_process()
        raise RuntimeError(f"docker-registry on {self.host} not ready after {READY_TIMEOUT}s ({last}):\n{self.log_text()}")

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def stop(self) -> None:
        self._stop_process()
        if self.issuer is not None:
            self.issuer.stop()

    def restart(self) -> None:
        self._stop_process()
        self._start()

    def start(self) -> None:
        """Start again after stop(), on the same port with the same storage."""
        self._start()


def start_registry(workdir: Path, auth: str = "none", tls: bool = False, token_ttl: int = 300,
                   realm_via: Callable[[str], str] | None = None, client_certs: bool = False) -> RunningRegistry:
    """`realm_via(issuer's host:port)`, when given, is the token realm the registry names instead of the
    issuer's own (a fault proxy in front of it). `client_certs` (with `tls`): mutual TLS, every
    connection without a client certificate its `client_ca` signed is refused in the handshake."""
    if auth not in ("none", "htpasswd", "token"):
        raise ValueError(f"unknown auth mode {auth!r}")
    if shutil.which(REGISTRY_BINARY) is None:
        raise RuntimeError(f"{REGISTRY_BINARY} not found on PATH (CNCF distribution is required by the tests)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / "storage"
    root.mkdir(exist_ok=True)
    port = free_port()
    host = f"127.0.0.1:{port}"
    config: dict = {
        "version": "0.1",
        "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(root)},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {"addr": host, "secret": "diskkit-test-http-secret"},
    }
    ca_dir = None
    if tls:
        ca_dir = workdir / "certs"
        _, cert, key = make_tls_files(ca_dir)
        config["http"]["tls"] = {"certificate": str(cert), "key": str(key)}
    client_ca = probe_dir = None
    if client_certs:
        client_ca = make_client_ca(workdir / "client-ca.crt")
        probe_dir = client_ca.issue(workdir / "probe", "probe")
        config["http"]["tls"]["clientcas"] = [str(client_ca.path)]
    username = password = None
    issuer = None
    if auth != "none":
        username, password = USERNAME, secrets.token_urlsafe(12)
    if auth == "htpasswd":
        htpasswd = workdir / "htpasswd"
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
        htpasswd.write_text(f"{username}:{hashed}\n")
        config["auth"] = {"htpasswd": {"realm": "diskkit-test-realm", "path": str(htpasswd)}}
    elif auth == "token":
        issuer = TokenIssuer(workdir, username, password, token_ttl)
        config["auth"] = {"token": {
            "realm": issuer.realm if realm_via is None else realm_via(f"127.0.0.1:{issuer.port}"), "service": TOKEN_SERVICE, "issuer": TOKEN_ISSUER,
            "rootcertbundle": str(issuer.bundle),
        }}
    config_path = workdir / "config.yml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    reg = RunningRegistry(
        host=host, root=root, auth=auth, tls=tls, ca_dir=ca_dir, username=username, password=password,
        token_requests=issuer.requests if issuer else [], config=config_path, log_path=workdir / "registry.log",
        issuer=issuer, client_ca=client_ca, probe_dir=probe_dir,
    )
    try:
        reg._start()
    except BaseException:
        reg.stop()
        raise
    return reg


# --- pytest fixtures (imported by conftest) -----------------------------------------------------

def _session_registry(tmp_path_factory, name: str, **kw):
    reg = start_registry(tmp_path_factory.mktemp(name), **kw)
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """Plain-HTTP registry, no authentication."""
    yield from _session_registry(tmp_path_factory, "registry")


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory):
    """htpasswd (Basic) authentication; distribution 2.8 accepts it over plain HTTP, so no TLS."""
    yield from _session_registry(tmp_path_factory, "auth-registry", auth="htpasswd")


@pytest.fixture(scope="session")
def tls_registry(tmp_path_factory):
    """HTTPS with a test CA (``ca_dir``), no authentication."""
    yield from _session_registry(tmp_path_factory, "tls-registry", tls=True)


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory):
    """Docker token authentication with an in-process issuer, plain HTTP."""
    yield from _session_registry(tmp_path_factory, "token-registry", auth="token")
