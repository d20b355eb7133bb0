"""A client for the OCI distribution API: auth challenges, TLS, retries and resumable transfers.

Why not oras-py for this: measured against a real registry (oras 0.2.43), its monolithic upload
reads the whole blob into memory (`fd.read()`), its blob download writes whatever arrives without
checking digest or size, its manifest upload re-serialises the JSON and forces the OCI manifest
media type (changing Docker manifests' digests), its manifest download returns parsed JSON so
the digest cannot be verified, and it resends a streaming body after a 401, which cannot work.
Every transfer here streams through requests instead, with those checks done.
"""

from __future__ import annotations

import atexit
import contextlib
import email.utils
import io
import json
import random
import re
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable
from urllib.parse import urljoin

import requests
import urllib3

from diskkit.errors import AuthError, DiskkitError, RegistryError
# How much of a small answer is read before it is refused (read_body): diskkit.limits, containers/image's.
from diskkit.limits import MAX_ERROR_BYTES, MAX_MANIFEST_BYTES, MAX_SIGNATURE_BYTES, MAX_TOKEN_BYTES  # noqa: F401 (callers import them from here)
from diskkit.registry import authfile, tlsfiles
from diskkit.registry.options import RegistryOptions
from diskkit.registry.partial import MIN_SIZE, Busy, PartialBlob

RETRY_STATUS = {408, 429, 500, 502, 503, 504}
# A redirect requests will not follow (another scheme, a malformed or endless one): never retried.
REDIRECT_REFUSALS = (requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL, requests.exceptions.TooManyRedirects)
USER_AGENT = "diskkit/0.1"
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"|(\w+)=([^\s,]+)')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = {}
    for m in _CHALLENGE_PARAM.finditer(rest):
        key = m.group(1) or m.group(3)
        params[key.lower()] = m.group(2) if m.group(1) else m.group(4)
    return scheme.lower(), params


def retry_after(response: requests.Response | None, attempt: int, opts: RegistryOptions) -> float:
    """The wait before the next attempt: Retry-After when the registry gives one, else backoff with jitter."""
    if response is not None:
        value = response.headers.get("Retry-After")
        if value:
            try:
                return min(float(value), opts.max_delay)
            except ValueError:
                when = email.utils.parsedate_to_datetime(value)
                if when is not None:
                    return min(max(when.timestamp() - time.time(), 0.0), opts.max_delay)
    delay = min(opts.backoff * (2**attempt), opts.max_delay)
    return delay / 2 + random.uniform(0, delay / 2)


Body = bytes | Callable[[], Iterable[bytes] | BinaryIO] | None


@dataclass
class _Token:
    value: str
    expires: float


class _ContextAdapter(requests.adapters.HTTPAdapter):
    """HTTPS through a TLS context of the registry client's own (requests' own takes file names)."""

    def __init__(self, context: ssl.SSLContext):
        self.context = context
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **{**kwargs, "ssl_context": self.context})


def tls_context(verify: bool, identity: tlsfiles.Identity | None) -> ssl.SSLContext:
    """The context a registry client's connections share. Unverified, it loads no CA bundle: urllib3's
    own would (about 20 ms, paid by every command's first request, the https probe of a plain-HTTP
    registry included) for checks it then does not make. The identity is loaded into it once, so no
    file of it stays open or on disk (tlsfiles.Materialized)."""
    if verify:
        context = ssl.create_default_context()  # the system's CAs, as urllib3's; private ones come per connection
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if identity is not None:
        with tlsfiles.Materialized(identity) as (cert, key):
            context.load_cert_chain(cert, key)
    return context


@dataclass
class Registry:
    """One registry host. Tokens are cached per scope and reused across requests."""

    host: str
    opts: RegistryOptions = field(default_factory=RegistryOptions)

    def __post_init__(self) -> None:
        self.opts = self.opts.for_endpoint()  # no --tls-verify and no registries.conf entry: verify
        self.session = requests.Session()
        self.session.headers["User-Agent"] = USER_AGENT
        self.scheme: str | None = None
        self.challenge: tuple[str, dict[str, str]] | None = None
        self.supports_signatures = False  # the /v2/ answer's X-Registry-Supports-Signatures: 1 (OpenShift's)
        self._creds: authfile.Credentials | None | bool = False  # False: not looked up yet
        self._tokens: dict[str, _Token] = {}
        self._bundle: tempfile._TemporaryFileWrapper | None = None
        self.identity: tlsfiles.Identity | None = None
        self._configure_tls()

    # --- connection -------------------------------------------------------------------------

    def _configure_tls(self) -> None:
        # The identity is presented whether or not the registry's certificate is verified, as
        # containers/image sets up certificates before it sets InsecureSkipVerify (docker/docker_client.go).
        self.identity = tlsfiles.held(self.host, self.opts)
        if not self.opts.tls_verify:
            self.session.verify = False
            self.session.mount("https://", _ContextAdapter(tls_context(False, self.identity)))
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            return
        if self.identity is not None:
            self.session.mount("https://", _ContextAdapter(tls_context(True, self.identity)))
        cas = tlsfiles.cas(self.host, self.opts.cert_dir)
        if cas:
            # Private CAs are added to the system's, as containers/image does with certs.d.
            self._bundle = tempfile.NamedTemporaryFile("wb", prefix="diskkit-ca-", suffix=".pem")
            atexit.register(self._bundle.close)  # removed at exit even if this client is never closed or collected
            system = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
            if system.is_file():
                self._bundle.write(system.read_bytes() + b"\n")
            for ca in cas:
                self._bundle.write(ca.read_bytes() + b"\n")
            self._bundle.flush()
            self.session.verify = self._bundle.name

    def base(self) -> str:
        if self.scheme is None:
            self.ping()
        return f"{self.scheme}://{self.host}"

    def ping(self) -> None:
        """GET /v2/: picks the scheme and learns how the registry wants to be authenticated."""
        schemes = ["https"] if self.opts.tls_verify else ["https", "http"]
        last: Exception | None = None
        for scheme in schemes:
            try:
                response = self._send("GET", f"{scheme}://{self.host}/v2/", {}, None)
            except requests.exceptions.SSLError as exc:
                last = exc
                self._refuse_identity(exc)
                if self.opts.tls_verify:
                    if "WRONG_VERSION_NUMBER" in str(exc):
                        # The TLS hello got an HTTP answer: no certificate setting can help here.
                        raise RegistryError(self.host, "the registry answered in plain HTTP, not HTTPS; use --tls-verify=false (or insecure = true for it in registries.conf)") from None
                    raise RegistryError(self.host, f"TLS verification failed ({tls_reason(exc)}); use --cert-dir for a private CA or --tls-verify=false") from None
                continue
            except requests.exceptions.ConnectionError as exc:
                last = exc
                self._refuse_identity(exc)
                continue
            except requests.exceptions.RequestException as exc:
                raise RegistryError(self.host, f"GET /v2/: {refusal(exc)}") from None
            # Only the status and headers are wanted; the (small) body is read all the same, so the
            # connection goes back to the pool for the next request rather than being closed.
            with contextlib.suppress(RegistryError):
                read_body(response, MAX_ERROR_BYTES, self.host, "GET /v2/")
            if response.status_code == 401 and "WWW-Authenticate" in response.headers:
                self.challenge = parse_challenge(response.headers["WWW-Authenticate"])
            elif response.status_code not in (200, 401):
                raise RegistryError(self.host, f"/v2/ answered HTTP {response.status_code}; is this an OCI registry?", status=response.status_code)
            self.scheme = scheme
            # containers/image docker/docker_client.go detectPropertiesHelper: exactly "1".
            self.supports_signatures = response.headers.get("X-Registry-Supports-Signatures") == "1"
            return
        raise RegistryError(self.host, f"cannot connect to the registry ({failure_reason(last)})", unreachable=True)

    def _refuse_identity(self, exc: BaseException) -> None:
        """A handshake the registry ended over the client certificate (mutual TLS: none was presented,
        or not one it accepts) is a refusal of credentials, said as one; never retried over plain HTTP.
        Under TLS 1.3 the server judges the certificate after the client's side of the handshake, and
        its alert can be lost to the reset of the connection it closes: an end of the connection in the
        handshake is said as the likely refusal it is."""
        alert = client_certificate_alert(exc)
        if alert is None:
            return
        if self.identity is None:
            raise AuthError(self.host, f"the registry wants a TLS client certificate and none was presented ({alert}); "
                                       f"put NAME.cert and NAME.key in --cert-dir or /etc/containers/certs.d/{self.host}/") from None
        raise AuthError(self.host, f"the registry refused the TLS client certificate {self.identity.origin} ({alert})") from None

    # --- auth ---------------------------------------------------------------------------------

    def credentials(self) -> authfile.Credentials | None:
        if self._creds is False:
            self._creds = authfile.held(self.host, self.opts)
        return self._creds  # type: ignore[return-value]

    def _auth_header(self, scope: str) -> dict[str, str]:
        if self.challenge is None:
            return {}
        scheme, params = self.challenge
        if scheme == "basic":
            creds = self.credentials()
            if creds is None:
                return {}
            return {"Authorization": requests.auth._basic_auth_str(creds.username, creds.password)}
        if scheme == "bearer":
            token = self._tokens.get(scope)
            if token is None or token.expires < time.time():
                token = self._fetch_token(params, scope)
                self._tokens[scope] = token
            return {"Authorization": f"Bearer {token.value}"} if token.value else {}
        return {}

    def _fetch_token(self, params: dict[str, str], scope: str) -> _Token:
        realm = params.get("realm")
        if not realm:
            raise AuthError(self.host, "bearer challenge without a realm")
        query = {"service": params.get("service", "")}
        if scope:
            query["scope"] = scope
        creds = self.credentials()
        for attempt in range(self.opts.retries + 1):
            try:
                if creds is not None and creds.identity_token:
                    response = self.session.post(
                        realm,
                        data={**query, "grant_type": "refresh_token", "refresh_token": creds.identity_token, "client_id": "diskkit"},
                        timeout=self.opts.timeout,
                        verify=self.session.verify,
                        stream=True,
                    )
                else:
                    auth = (creds.username, creds.password) if creds else None
                    response = self.session.get(realm, params=query, auth=auth, timeout=self.opts.timeout, verify=self.session.verify, stream=True)
            except REDIRECT_REFUSALS as exc:
                raise RegistryError(self.host, f"token service {realm}: {refusal(exc)}") from None
            except requests.exceptions.RequestException as exc:
                if attempt == self.opts.retries:
                    raise RegistryError(self.host, f"token service {realm} unreachable ({failure_reason(exc)})", unreachable=True) from None
                time.sleep(retry_after(None, attempt, self.opts))
                continue
            if response.status_code in RETRY_STATUS and attempt < self.opts.retries:
                response.close()
                time.sleep(retry_after(response, attempt, self.opts))
                continue
            break
        data = read_body(response, MAX_TOKEN_BYTES, self.host, f"token service {realm} answer")
        if response.status_code in (401, 403):
            who = f"as {creds.username}" if creds else "anonymously"
            raise AuthError(self.host, f"token service refused {who} for scope {scope or '(none)'}{credentials_hint(creds is not None, self.opts.authfile)}", status=response.status_code)
        if response.status_code != 200:
            raise AuthError(self.host, f"token service answered HTTP {response.status_code} for scope {scope}", status=response.status_code, unreachable=response.status_code >= 500)
        try:
            body = json.loads(data)
            value = body.get("token") or body.get("access_token") or ""
            lifetime = int(body.get("expires_in") or 60)
        except (ValueError, TypeError, AttributeError):
            raise AuthError(self.host, "token service answered something other than a JSON token") from None
        if not isinstance(value, str):
            raise AuthError(self.host, "token service answered something other than a JSON token")
        return _Token(value, time.time() + max(lifetime - 10, 5))

    # --- requests -----------------------------------------------------------------------------

    def _send(self, method: str, url: str, headers: dict, body: Body) -> requests.Response:
        data = body() if callable(body) else body
        # verify= is passed on every call: requests lets REQUESTS_CA_BUNDLE override a session's setting.
        # Always streamed: requests would otherwise read a whole body, however large, before returning.
        return self.session.request(
            method, url, headers=headers, data=data, stream=True, timeout=self.opts.timeout, allow_redirects=True,
            verify=self.session.verify,
        )

    def request(
        self,
        method: str,
        path: str,
        scope: str,
        headers: dict[str, str] | None = None,
        body: Body = None,
        stream: bool = False,
        what: str = "",
        retry: bool = True,
    ) -> requests.Response:
        """One API call, with auth and retries. `body`, if it is to be retried, must be bytes or a factory.

        Unless `stream`, the answer's body is read here, up to MAX_ERROR_BYTES (refused beyond);
        callers that expect more (manifests) stream it and read it with their own limit (read_body)."""
        url = path if path.startswith(("http://", "https://")) else self.base() + path
        authed_again = False
        attempt = 0 if retry else self.opts.retries
        while True:
            all_headers = {**self._auth_header(scope), **(headers or {})}
            try:
                response = self._send(method, url, all_headers, body)
            except requests.exceptions.SSLError as exc:
                raise RegistryError(self.host, f"TLS error ({failure_reason(exc)})") from None
            except REDIRECT_REFUSALS as exc:
                raise RegistryError(self.host, f"{what or method}: {refusal(exc)}") from None
            except ValueError:  # urllib's own parsing of a Location requests could not make sense of
                raise RegistryError(self.host, f"{what or method}: redirected to an invalid URL; refused") from None
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, urllib3.exceptions.HTTPError) as exc:
                if attempt >= self.opts.retries:
                    raise RegistryError(self.host, f"{what or method} failed after {attempt + 1} attempts ({failure_reason(exc)})", unreachable=True) from None
                time.sleep(retry_after(None, attempt, self.opts))
                attempt += 1
                continue
            if response.status_code == 401 and not authed_again:
                authed_again = True
                challenge = response.headers.get("WWW-Authenticate")
                if challenge:
                    response.close()
                    self.challenge = parse_challenge(challenge)
                    self._tokens.pop(scope, None)
                    continue
            if response.status_code in (401, 403):
                creds = self.credentials()
                who = f"user {creds.username}" if creds else "anonymous access"
                if method != "HEAD":
                    _read_into(response, MAX_ERROR_BYTES, self.host, what or method)
                hint = credentials_hint(creds is not None, self.opts.authfile) if response.status_code == 401 else ""
                raise AuthError(self.host, f"{what or method} denied for {who} (scope {scope}): HTTP {response.status_code}{_api_error(response)}{hint}",
                                status=response.status_code, code=api_error_code(response))
            if response.status_code in RETRY_STATUS and attempt < self.opts.retries:
                time.sleep(retry_after(response, attempt, self.opts))
                response.close()
                attempt += 1
                continue
            if method == "HEAD" or response.status_code in (204, 304):
                response._content = b""  # no body, whatever Content-Length says (the blob's, for HEAD)
                response.close()
            elif not stream or response.status_code not in (200, 206):
                # Error answers of streamed requests too: callers read their `errors` (_api_error).
                _read_into(response, MAX_ERROR_BYTES, self.host, what or method)
            return response  # callers decide what 404 and other answers mean

    def resolve(self, location: str) -> str:
        return urljoin(self.base() + "/", location)

    def close(self) -> None:
        self.session.close()
        if self._bundle is not None:
            self._bundle.close()


def credentials_hint(had_credentials: bool, authfile_option: str | None = None) -> str:
    """How to give credentials, in the words of the flags and files this tool reads (authfile.py)."""
    if had_credentials:
        return "; the credentials were refused: check --creds, --authfile or the auth file found (authfile search: $REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json, ~/.docker/config.json)"
    hidden = "".join(f"; {why}" for why in authfile.out_of_reach(authfile_option))
    return f"{hidden}; give credentials with --creds USER:PASS, --authfile FILE or $REGISTRY_AUTH_FILE, or log in with `skopeo login` / `podman login` (read from their auth.json)"


def scope(repository: str, actions: str) -> str:
    return f"repository:{repository}:{actions}"


def failure_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc)
    for marker in ("Caused by ", "Failed to establish a new connection: "):
        if marker in text:
            text = text.split(marker, 1)[1]
    return text.strip("()'\" ")[:200]


def refusal(exc: BaseException) -> str:
    """The rule a hostile or broken answer broke, in words, for the exceptions requests raises."""
    if isinstance(exc, requests.exceptions.InvalidSchema):
        return "redirected to a location that is not http(s); refused"
    if isinstance(exc, requests.exceptions.InvalidURL):
        return "redirected to an invalid URL; refused"
    if isinstance(exc, requests.exceptions.TooManyRedirects):
        return "too many redirects; refused"
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.ProtocolError)):
        return f"the answer's body was cut short ({failure_reason(exc)})"
    if isinstance(exc, (requests.exceptions.ContentDecodingError, urllib3.exceptions.DecodeError)):
        return "the answer's body cannot be decoded (bad Content-Encoding)"
    return failure_reason(exc)


def read_body(response: requests.Response, limit: int, where: str, what: str) -> bytes:
    """At most `limit` bytes of a streamed answer's body, as containers/image's ReadAtMost: one byte
    more is read to tell a body at the limit from a larger one, which is refused; memory stays
    bounded whatever the registry sends (an endless manifest grew a launcher to 23.7 GB)."""
    try:
        declared = int(response.headers.get("Content-Length", ""))
    except ValueError:
        declared = -1
    data = bytearray()
    try:
        if declared <= limit:
            while len(data) <= limit:
                # decode_content: a Content-Encoding is undone piece by piece, bounded the same way
                piece = response.raw.read(min(1 << 20, limit + 1 - len(data)), decode_content=True)
                if not piece:
                    break
                data += piece
    except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as exc:
        raise RegistryError(where, f"{what}: {refusal(exc)}") from None
    finally:
        response.close()
    if declared > limit or len(data) > limit:
        raise RegistryError(where, f"{what} is larger than {_size(limit)}, the limit for it; refused")
    return bytes(data)


def _read_into(response: requests.Response, limit: int, where: str, what: str) -> None:
    """Reads the body (read_body) into the response, where .content and .json() find it."""
    response._content = read_body(response, limit, where, what)  # requests' own cache of the body


def _size(n: int) -> str:
    return f"{n >> 20} MiB ({n} bytes)" if n >= 1 << 20 else f"{n} bytes"


# The alerts a TLS server sends when it requires a client certificate and got none or one it does not
# accept (RFC 8446 section 4.4.2.4, RFC 5246 section 7.4.6; Go's crypto/tls, the distribution
# registry's, sends bad_certificate for both in TLS 1.2 and certificate_required in 1.3), as OpenSSL names them.
_CLIENT_CERTIFICATE_ALERTS = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_UNKNOWN")
_HANDSHAKE_CUT = ("EOF occurred in violation of protocol", "UNEXPECTED_EOF")  # OpenSSL's words: only TLS ends so


def client_certificate_alert(exc: BaseException) -> str | None:
    """How the registry ended the handshake when it did so over the client certificate (its alert, or a
    connection cut before any answer), else None."""
    import re

    text = str(exc)
    found = re.search(r"\[SSL: ([A-Z0-9_]+)\] ([^(']+?)\s*\(_ssl", text)
    if found and "ALERT" in found.group(1) and any(found.group(1).endswith(name) for name in _CLIENT_CERTIFICATE_ALERTS):
        return found.group(2)
    if any(cut in text for cut in _HANDSHAKE_CUT):
        return "the connection was closed in the TLS handshake"
    return None


def tls_reason(exc: BaseException) -> str:
    """OpenSSL's reason, without the layers of exception reprs around it."""
    import re

    found = re.search(r"\[SSL: [A-Z_]+\] ([^(']+?)\s*\(_ssl", str(exc))
    return found.group(1) if found else failure_reason(exc)


def _api_errors(response: requests.Response) -> list:
    if response._content is False:  # a streamed answer whose body is not read: not read for this either
        return []
    try:
        errors = response.json().get("errors") or []
        return errors if isinstance(errors, list) and all(isinstance(e, dict) for e in errors) else []
    except (ValueError, AttributeError, TypeError):
        return []


def _api_error(response: requests.Response) -> str:
    errors = _api_errors(response)
    return f" ({errors[0].get('code')}: {errors[0].get('message')})"[:300] if errors else ""


def api_error_code(response: requests.Response) -> str | None:
    """The distribution API's code for the answer's first error (NAME_UNKNOWN, DENIED...), if it names one."""
    errors = _api_errors(response)
    code = errors[0].get("code") if errors else None
    return code[:100] if isinstance(code, str) else None


def check_status(response: requests.Response, expect: tuple[int, ...], host: str, what: str) -> requests.Response:
    if response.status_code not in expect:
        raise RegistryError(host, f"{what}: HTTP {response.status_code}{_api_error(response)}", status=response.status_code, code=api_error_code(response))
    return response


def get_blob(registry: Registry, repository: str, digest: str, first: int = 0, last: int | None = None, skip_whole: bool = True) -> requests.Response:
    """A streaming GET of a blob from byte `first` (through `last`), positioned at `first` even when
    the registry ignores Range and answers with the whole blob; with skip_whole=False such an answer
    (status 200) is returned unread, for a caller that would rather not read up to `first`."""
    ranged = bool(first) or last is not None
    headers = {"Range": f"bytes={first}-{'' if last is None else last}"} if ranged else {}
    what = f"GET blob {digest[:19]}" + (" range" if last is not None else "")
    response = registry.request("GET", f"/v2/{repository}/blobs/{digest}", scope(repository, "pull"), headers=headers, stream=True, what=what)
    try:
        if response.status_code == 404:
            raise RegistryError(registry.host, f"blob {digest} not found (HTTP 404)", status=404, code=api_error_code(response))
        check_status(response, (200, 206), registry.host, what)
        if response.status_code == 200 and ranged and not skip_whole:
            return response
        if response.status_code == 200:
            skip = first
            while skip:
                try:
                    piece = response.raw.read(min(skip, 1 << 20))
                except (urllib3.exceptions.HTTPError, OSError) as exc:
                    raise RegistryError(registry.host, f"blob {digest[:19]}: {refusal(exc)}") from None
                if not piece:
                    raise RegistryError(registry.host, f"blob {digest[:19]} ended before byte {first}")
                skip -= len(piece)
        elif ranged:
            answered = response.headers.get("Content-Range", "")
            if not answered.startswith(f"bytes {first}-"):
                raise RegistryError(registry.host, f"asked for bytes {first}-{'' if last is None else last} of {digest[:19]}, got {answered or 'no Content-Range'}")
    except BaseException:
        response.close()
        raise
    return response


class ResumableBlob(io.RawIOBase):
    """A blob download that survives dropped connections by asking again with `Range: bytes=N-`.

    With `partial_dir` what arrives is also kept there (diskkit.registry.partial), so a download
    of the same blob by a later process, after this one was killed, starts where it stopped."""

    def __init__(self, registry: Registry, repository: str, digest: str, size: int, partial_dir: Path | None = None):
        self.registry = registry
        self.repository = repository
        self.digest = digest
        self.size = size
        self.offset = 0
        self.resumes = 0
        self._response: requests.Response | None = None
        self.partial: PartialBlob | None = None
        if partial_dir is not None and size >= MIN_SIZE:
            try:
                self.partial = PartialBlob(partial_dir, digest, f"{registry.host}/{repository}@{digest} {size}")
            except (Busy, OSError, DiskkitError):
                pass  # another process downloads it now (or the directory is unusable): no head start
        self.resumed = self.partial.kept if self.partial is not None else 0  # bytes taken from an earlier download
        # Where an earlier download's kept bytes begin: the bytes before them are fetched first.
        self.partial_start = self.partial.start if self.resumed else 0
        if not self.resumed:
            self._open()

    def readable(self) -> bool:
        return True

    def _open(self) -> None:
        head = self.offset < self.partial_start
        self._response = get_blob(self.registry, self.repository, self.digest, self.offset, self.partial_start - 1 if head else None)

    def readinto(self, buf) -> int:
        data = self._next(len(buf))
        buf[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        # The bytes object as received, without the copy into a caller's buffer readinto makes.
        if size is None or size < 0:
            return self.readall()
        return self._next(size)

    def _next(self, limit: int) -> bytes:
        limit = min(limit, 1 << 20)
        if not limit:
            return b""
        if self.partial is not None and self.partial_start <= self.offset < self.partial.length:
            data = self.partial.read(self.offset, limit)
            self.offset += len(data)
            return data
        if self._response is None:
            self._open()  # the bytes before the kept ones, or after them: from the registry
        if self.offset < self.partial_start:
            limit = min(limit, self.partial_start - self.offset)
        while True:
            try:
                assert self._response is not None
                # On a reset only what is inside the failing read (at most 1 MiB) is fetched again.
                data = self._response.raw.read(limit)
            except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as exc:
                data = None
                failure: BaseException | None = exc
            else:
                failure = None
            if data:
                if self.partial is not None:
                    self.partial.append(self.offset, data)
                self.offset += len(data)
                if self.offset == self.partial_start:
                    self._response.close()  # the head is in: the kept bytes come next
                    self._response = None
                return data
            if failure is None and self.offset >= self.size:
                return b""
            if self.partial is not None:
                self.partial.sync()  # whatever happens next, what came so far is not fetched again
            # Connection dropped, or the body ended before the descriptor's size: resume.
            if self.resumes >= self.registry.opts.retries:
                raise RegistryError(self.registry.host, f"blob {self.digest[:19]} download kept failing at byte {self.offset} of {self.size} ({failure_reason(failure) if failure else 'short body'})")
            if self._response is not None:
                self._response.close()
            time.sleep(retry_after(None, self.resumes, self.registry.opts))
            self.resumes += 1
            self._open()

    def discard(self) -> None:
        """The blob failed its checks: what was kept of it is not offered to any later download."""
        if self.partial is not None:
            self.partial.drop()
            self.partial = None

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
        if self.partial is not None:
            # Read to the end, the consumer has checked the digest (or refused the blob): done either way.
            if self.offset >= self.size:
                self.partial.drop()
            else:
                self.partial.keep()
            self.partial = None
        super().close()
