"""The test peers themselves: real distribution registries (tests/distribution.py) and the fault proxy
(tests/faultproxy.py), exercised with requests and skopeo only — never diskkit — so that a diskkit test
failing against them cannot be blamed on the peers."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import requests

from tests.distribution import decode_jwt_claims, start_registry
from tests.faultproxy import Fault, FaultProxy
from tests.imagecraft import put_blob

MODES = ["registry", "auth_registry", "tls_registry", "token_registry"]


# --- helpers ------------------------------------------------------------------------------------

def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict:
    """A tiny hand-made OCI layout (one layer) tagged "v1"."""
    root = tmp_path_factory.mktemp("layout")
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        return put_blob(blobs, data)

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        payload = b"hello from test_peers\n" * 100
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mode = len(payload), 0o644
        tar.addfile(info, io.BytesIO(payload))
    layer = gzip.compress(raw.getvalue(), mtime=0)
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [sha256(raw.getvalue())]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put(layer), "size": len(layer)}],
    }).encode()
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))
    return {"path": root, "manifest": sha256(manifest), "layer": sha256(layer), "layer_bytes": layer}


@pytest.fixture(scope="module")
def skopeo_env(tmp_path_factory) -> dict:
    """Keep skopeo away from any credentials of the machine."""
    home = tmp_path_factory.mktemp("skopeo-home")
    empty = home / "auth.json"
    empty.write_text('{"auths": {}}')
    return {**os.environ, "HOME": str(home), "REGISTRY_AUTH_FILE": str(empty), "XDG_RUNTIME_DIR": str(home)}


def skopeo(env: dict, *args) -> subprocess.CompletedProcess:
    # FileNotFoundError (no skopeo) fails the test, as it must.
    proc = subprocess.run(["skopeo", *map(str, args)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, f"skopeo {' '.join(map(str, args))} failed:\n{proc.stderr}"
    return proc


def dest_flags(reg) -> list[str]:
    flags = [f"--dest-cert-dir={reg.ca_dir}"] if reg.tls else ["--dest-tls-verify=false"]
    if reg.username:
        flags.append(f"--dest-creds={reg.username}:{reg.password}")
    return flags


def src_flags(reg, tmp_path: Path) -> list[str]:
    flags = [f"--cert-dir={reg.ca_dir}"] if reg.tls else ["--tls-verify=false"]
    if reg.username:
        flags.append(f"--authfile={reg.auth_file(tmp_path / 'config.json')}")
    return flags


def push_blob(base: str, repo: str, data: bytes) -> str:
    """POST + monolithic PUT straight to an unauthenticated registry."""
    digest = sha256(data)
    r = requests.post(f"{base}/v2/{repo}/blobs/uploads/", timeout=10)
    assert r.status_code == 202, r.text
    r = requests.put(r.headers["Location"], params={"digest": digest}, data=data, timeout=10,
                     headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return digest


# --- the registries -----------------------------------------------------------------------------

def test_plain_registry_answers(registry):
    r = requests.get(registry.url(), timeout=5)
    assert r.status_code == 200 and r.headers["Docker-Distribution-Api-Version"] == "registry/2.0"
    assert registry.url("/v2/x/tags/list") == f"http://{registry.host}/v2/x/tags/list"
    assert registry.ca_dir is None and registry.username is None and registry.auth == "none"


def test_tls_registry_answers(tls_registry):
    assert (tls_registry.ca_dir / "ca.crt").is_file()
    assert tls_registry.url().startswith("https://127.0.0.1:")
    r = requests.get(tls_registry.url(), verify=str(tls_registry.ca_dir / "ca.crt"), timeout=5)
    assert r.status_code == 200
    with pytest.raises(requests.exceptions.SSLError):  # the CA is really needed
        requests.get(tls_registry.url(), timeout=5)
    r = requests.get(f"http://{tls_registry.host}/v2/", timeout=5)  # and it is really TLS
    assert r.status_code == 400


def test_htpasswd_registry_answers(auth_registry):
    r = requests.get(auth_registry.url(), verify=auth_registry.verify, timeout=5)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == 'Basic realm="diskkit-test-realm"'
    good = requests.get(auth_registry.url(), auth=(auth_registry.username, auth_registry.password),
                        verify=auth_registry.verify, timeout=5)
    assert good.status_code == 200
    bad = requests.get(auth_registry.url(), auth=(auth_registry.username, "wrong"), verify=auth_registry.verify, timeout=5)
    assert bad.status_code == 401


def test_token_registry_answers(token_registry):
    reg = token_registry
    r = requests.get(reg.url(), timeout=5)
    assert r.status_code == 401
    realm = f"http://{reg.issuer.realm.split('//', 1)[1]}"
    assert r.headers["WWW-Authenticate"] == f'Bearer realm="{realm}",service="diskkit-test"'

    scope = "repository:peers/probe:pull,push"
    before = len(reg.token_requests)
    full = requests.get(realm, params={"service": "diskkit-test", "scope": scope}, auth=(reg.username, reg.password), timeout=5)
    assert full.status_code == 200
    body = full.json()
    assert body["token"] == body["access_token"] and body["expires_in"] == 300 and body["issued_at"]
    claims = decode_jwt_claims(body["token"])
    assert claims["iss"] == "diskkit-test-issuer" and claims["aud"] == "diskkit-test" and claims["sub"] == "diskkit"
    assert claims["access"] == [{"type": "repository", "name": "peers/probe", "actions": ["pull", "push"]}]
    assert requests.get(reg.url(), headers={"Authorization": f"Bearer {body['token']}"}, timeout=5).status_code == 200

    # space-separated scopes, anonymous: pull only
    anon = requests.get(realm, params={"service": "diskkit-test", "scope": f"{scope} repository:other:pull"}, timeout=5)
    assert anon.status_code == 200
    assert decode_jwt_claims(anon.json()["token"])["access"] == [
        {"type": "repository", "name": "peers/probe", "actions": ["pull"]},
        {"type": "repository", "name": "other", "actions": ["pull"]},
    ]
    # an anonymous (pull-only) token cannot start an upload
    r = requests.post(reg.url("/v2/peers/probe/blobs/uploads/"), headers={"Authorization": f"Bearer {anon.json()['token']}"}, timeout=5)
    assert r.status_code == 401 and 'error="insufficient_scope"' in r.headers["WWW-Authenticate"]

    bad = requests.get(realm, params={"service": "diskkit-test", "scope": scope}, auth=(reg.username, "nope"), timeout=5)
    assert bad.status_code == 401
    assert reg.token_requests[before:] == [
        {"user": "diskkit", "scope": [scope], "service": "diskkit-test"},
        {"user": None, "scope": [scope, "repository:other:pull"], "service": "diskkit-test"},
        {"user": "diskkit", "scope": [scope], "service": "diskkit-test"},
    ]


def test_expired_token_is_refused(token_registry):
    reg = token_registry
    access = [{"type": "repository", "name": "peers/probe", "actions": ["pull"]}]
    good = reg.issuer.issue("diskkit", "diskkit-test", access)
    old = reg.issuer.issue("diskkit", "diskkit-test", access, ttl=-3600)
    url = reg.url("/v2/peers/probe/tags/list")
    assert requests.get(url, headers={"Authorization": f"Bearer {good}"}, timeout=5).status_code == 404  # authorised, no repo
    assert requests.get(url, headers={"Authorization": f"Bearer {old}"}, timeout=5).status_code == 401


@pytest.mark.parametrize("mode", MODES)
def test_skopeo_push_and_inspect(mode, request, layout, skopeo_env, tmp_path):
    reg = request.getfixturevalue(mode)
    before = len(reg.token_requests)
    dest = f"docker://{reg.host}/peers/{mode.replace('_', '-')}:v1"
    skopeo(skopeo_env, "copy", "--quiet", *dest_flags(reg), f"oci:{layout['path']}:v1", dest)
    info = json.loads(skopeo(skopeo_env, "inspect", "--raw", *src_flags(reg, tmp_path), dest).stdout)
    assert info["layers"][0]["digest"] == layout["layer"]
    digest = json.loads(skopeo(skopeo_env, "inspect", *src_flags(reg, tmp_path), dest).stdout)["Digest"]
    assert digest == layout["manifest"]
    assert reg.blob_data_path(layout["layer"]).read_bytes() == layout["layer_bytes"]
    if mode == "token_registry":
        seen = reg.token_requests[before:]
        assert all(t["service"] == "diskkit-test" for t in seen)
        pushes = [s for t in seen if t["user"] == "diskkit" for s in t["scope"]
                  if s.startswith("repository:peers/token-registry:") and "push" in s.rsplit(":", 1)[1].split(",")]
        assert pushes, seen
    if reg.auth == "htpasswd":  # without credentials the registry refuses (token mode lets anonymous pull)
        proc = subprocess.run(["skopeo", "inspect", *(["--cert-dir", str(reg.ca_dir)] if reg.tls else ["--tls-verify=false"]), dest],
                              capture_output=True, text=True, env=skopeo_env, timeout=60)
        assert proc.returncode != 0


def test_auth_file_format(auth_registry, registry, tmp_path):
    data = json.loads(auth_registry.auth_file(tmp_path / "a" / "config.json").read_text())
    assert base64.b64decode(data["auths"][auth_registry.host]["auth"]).decode() == f"diskkit:{auth_registry.password}"
    assert json.loads(registry.auth_file(tmp_path / "b.json").read_text()) == {"auths": {}}


def test_restart_keeps_images(tmp_path, layout, skopeo_env):
    reg = start_registry(tmp_path / "reg", auth="htpasswd", tls=True)
    try:
        dest = f"docker://{reg.host}/peers/restart:v1"
        skopeo(skopeo_env, "copy", "--quiet", *dest_flags(reg), f"oci:{layout['path']}:v1", dest)
        host = reg.host
        reg.restart()
        assert reg.host == host
        digest = json.loads(skopeo(skopeo_env, "inspect", *src_flags(reg, tmp_path), dest).stdout)["Digest"]
        assert digest == layout["manifest"]
        reg.stop()
        with pytest.raises(requests.ConnectionError):
            requests.get(reg.url(), verify=reg.verify, timeout=2)
        reg.restart()  # also after a full stop
        assert requests.get(reg.url(), verify=reg.verify, timeout=5).status_code == 401
    finally:
        reg.stop()


def test_start_failure_reports_log(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        reg = start_registry(tmp_path / "ok")
        reg.stop()
        reg.host = f"127.0.0.1:{busy.getsockname()[1]}"  # force a bind failure on restart
        cfg = json.loads(reg.config.read_text())
        cfg["http"]["addr"] = reg.host
        reg.config.write_text(json.dumps(cfg))
        with pytest.raises(RuntimeError, match="address already in use"):
            reg.restart()
    finally:
        busy.close()


# --- the fault proxy ----------------------------------------------------------------------------

@pytest.fixture
def proxy(registry):
    with FaultProxy(registry.host) as p:
        yield p


@pytest.fixture(scope="module")
def big_blob(registry) -> tuple[str, bytes]:
    data = os.urandom(300 * 1024 + 17)
    return push_blob(f"http://{registry.host}", "peers/faults", data), data


def blob_url(proxy, digest: str) -> str:
    return proxy.url(f"/v2/peers/faults/blobs/{digest}")


def test_proxy_passes_skopeo_through(proxy, registry, layout, skopeo_env):
    dest = f"docker://{proxy.host}/peers/via-proxy:v1"
    skopeo(skopeo_env, "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout['path']}:v1", dest)
    direct = json.loads(skopeo(skopeo_env, "inspect", "--tls-verify=false", f"docker://{registry.host}/peers/via-proxy:v1").stdout)
    via = json.loads(skopeo(skopeo_env, "inspect", "--tls-verify=false", dest).stdout)
    assert direct["Digest"] == via["Digest"] == layout["manifest"]
    methods = {m for m, _, _ in proxy.log}
    assert {"PUT", "HEAD", "GET"} <= methods and ("PATCH" in methods or "POST" in methods)
    assert all(status < 500 for _, _, status in proxy.log), proxy.log
    assert any(m == "PUT" and "/manifests/v1" in p and s == 201 for m, p, s in proxy.log)


def test_proxy_streams_ranges_and_keeps_host(proxy, big_blob):
    digest, data = big_blob
    r = requests.get(blob_url(proxy, digest), timeout=10)
    assert r.status_code == 200 and r.content == data and r.headers["Docker-Content-Digest"] == digest
    r = requests.get(blob_url(proxy, digest), headers={"Range": "bytes=70000-70009"}, timeout=10)
    assert r.status_code == 206 and r.content == data[70000:70010]
    assert r.headers["Content-Range"] == f"bytes 70000-70009/{len(data)}"
    h = requests.head(blob_url(proxy, digest), timeout=10)
    assert h.status_code == 200 and int(h.headers["Content-Length"]) == len(data)

    # chunked upload through the proxy; Location points back at the proxy
    start = requests.post(proxy.url("/v2/peers/faults/blobs/uploads/"), timeout=10)
    assert start.status_code == 202 and start.headers["Docker-Upload-UUID"]
    location = start.headers["Location"]
    assert location.startswith(f"http://{proxy.host}/v2/peers/faults/blobs/uploads/")
    payload = os.urandom(200_000)
    r = requests.patch(location, data=(payload[i:i + 50_000] for i in range(0, len(payload), 50_000)),
                       headers={"Content-Type": "application/octet-stream"}, timeout=10)
    assert r.status_code == 202 and r.headers["Range"] == f"0-{len(payload) - 1}"
    r = requests.put(r.headers["Location"], params={"digest": sha256(payload)}, timeout=10)
    assert r.status_code == 201 and r.headers["Docker-Content-Digest"] == sha256(payload)
    assert requests.get(blob_url(proxy, sha256(payload)), timeout=10).content == payload


def test_fault_status_once_then_passes(proxy, big_blob):
    digest, data = big_blob
    proxy.add(Fault("GET", r"/blobs/sha256:", "status", arg=503))
    with requests.Session() as s:  # same keep-alive connection for both
        r = s.get(blob_url(proxy, digest), timeout=10)
        assert r.status_code == 503 and r.json() == {"errors": []}
        r = s.get(blob_url(proxy, digest), timeout=10)
        assert r.status_code == 200 and r.content == data
    assert [st for m, p, st in proxy.log if digest in p] == [503, 200]


def test_fault_times_and_any_method(proxy):
    proxy.add(Fault("*", r"^/v2/$", "status", times=2, arg=500))
    assert [requests.get(proxy.url(), timeout=5).status_code for _ in range(3)] == [500, 500, 200]
    assert proxy.pending == []
    proxy.add(Fault("GET", r"/nomatch", "status", arg=500))
    proxy.clear()
    assert proxy.pending == [] and requests.get(proxy.url(), timeout=5).status_code == 200


def test_fault_retry_after(proxy):
    proxy.add(Fault("HEAD", r"/manifests/", "retry_after", arg=7))
    r = requests.head(proxy.url("/v2/peers/faults/manifests/v1"), timeout=5)
    assert r.status_code == 429 and r.headers["Retry-After"] == "7"
    assert requests.head(proxy.url("/v2/peers/faults/manifests/v1"), timeout=5).status_code == 404


def test_fault_flip(proxy, big_blob):
    digest, data = big_blob
    proxy.add(Fault("GET", digest, "flip", arg=65536 + 3))  # in the second 64 KiB piece
    r = requests.get(blob_url(proxy, digest), timeout=10)
    assert r.status_code == 200 and len(r.content) == len(data)
    assert sha256(r.content) != digest
    diff = [i for i in range(len(data)) if r.content[i] != data[i]]
    assert diff == [65539] and r.content[65539] ^ data[65539] == 1


def read_raw(proxy, path: str) -> tuple[int, int, bytes, str]:
    """GET on a bare socket: (status, Content-Length, body bytes received, "eof" | "reset")."""
    host, port = proxy.host.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {proxy.host}\r\n\r\n".encode())
        buf, end = b"", "eof"
        while True:
            try:
                piece = s.recv(65536)
            except ConnectionResetError:
                end = "reset"
                break
            if not piece:
                break
            buf += piece
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), int(headers["Content-Length"]), body, end


@pytest.mark.parametrize(
    "action, sent, end, seen_as",
    [
        ("truncate", 100_000, "eof", (requests.exceptions.ChunkedEncodingError,)),
        ("drop", 1000, "reset", (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError)),
    ],
)
def test_fault_cuts_a_blob_body(proxy, big_blob, action, sent, end, seen_as):
    digest, data = big_blob
    proxy.add(Fault("GET", digest, action, arg=sent))
    status, length, body, how = read_raw(proxy, f"/v2/peers/faults/blobs/{digest}")
    assert (status, length, how) == (200, len(data), end)
    assert body == data[:sent]
    proxy.add(Fault("GET", digest, action, arg=sent))
    with pytest.raises(seen_as):  # as a requests user sees it
        requests.get(blob_url(proxy, digest), timeout=10)
    assert requests.get(blob_url(proxy, digest), timeout=10).content == data


def test_fault_drop_patch_leaves_partial_upload(proxy, registry):
    """The registry keeps the forwarded prefix; distribution 2.8 then refuses the client's stale upload URL
    (its _state still says offset 0): GET answers 404 BLOB_UPLOAD_INVALID."""
    payload = os.urandom(150_000)
    start = requests.post(proxy.url("/v2/peers/faults/blobs/uploads/"), timeout=10)
    location, uuid = start.headers["Location"], start.headers["Docker-Upload-UUID"]
    proxy.add(Fault("PATCH", r"/blobs/uploads/", "drop", arg=40_000))
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.patch(location, data=payload, headers={"Content-Type": "application/octet-stream"}, timeout=10)
    assert ("PATCH", location.split(proxy.host, 1)[1], 0) in proxy.log
    partial = registry.root / "docker/registry/v2/repositories/peers/faults/_uploads" / uuid / "data"
    assert partial.stat().st_size == 40_000 and partial.read_bytes() == payload[:40_000]
    status = requests.get(location, timeout=10)
    assert status.status_code == 404 and status.json()["errors"][0]["code"] == "BLOB_UPLOAD_INVALID"
    # arg=0: nothing reaches the registry, the upload URL stays valid at offset 0
    start = requests.post(proxy.url("/v2/peers/faults/blobs/uploads/"), timeout=10)
    location = start.headers["Location"]
    proxy.add(Fault("PATCH", r"/blobs/uploads/", "drop", arg=0))
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.patch(location, data=payload, headers={"Content-Type": "application/octet-stream"}, timeout=10)
    status = requests.get(location, timeout=10)
    assert status.status_code == 204 and status.headers["Range"] == "0-0"
    r = requests.patch(location, data=payload, headers={"Content-Type": "application/octet-stream"}, timeout=10)
    assert r.status_code == 202 and r.headers["Range"] == f"0-{len(payload) - 1}"
    r = requests.put(r.headers["Location"], params={"digest": sha256(payload)}, timeout=10)
    assert r.status_code == 201
    assert requests.get(registry.url(f"/v2/peers/faults/blobs/{sha256(payload)}"), timeout=10).content == payload


def test_fault_stall(proxy):
    proxy.add(Fault("GET", r"^/v2/$", "stall", arg=0.5))
    t = time.monotonic()
    assert requests.get(proxy.url(), timeout=5).status_code == 200
    assert time.monotonic() - t >= 0.5
    proxy.add(Fault("GET", r"^/v2/$", "stall", arg=2))
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(proxy.url(), timeout=0.3)


def test_proxy_close_is_clean(registry):
    p = FaultProxy(registry.host)
    s = requests.Session()
    assert s.get(p.url(), timeout=5).status_code == 200  # leaves a keep-alive connection open
    p.add(Fault("GET", r"^/v2/$", "stall", arg=60))
    t = time.monotonic()
    p.close()
    assert time.monotonic() - t < 3
    with pytest.raises(requests.ConnectionError):
        requests.get(p.url(), timeout=2)
    s.close()
    with pytest.raises(ValueError):
        FaultProxy("example.com:80")
    with pytest.raises(ValueError):
        Fault("GET", "/", "explode")
