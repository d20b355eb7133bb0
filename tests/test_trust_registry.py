"""The registry side of the node's trust boundary (issue 29): the registry is trusted only through
digests and signatures, so what a lying one sends is bounded, refused in one line and never kept for
a later pull of the genuine image. A real registry throughout; the lies come from the fault proxy
in front of it (tests/faultproxy.py).

The size limits are containers/image's (internal/iolimits/iolimits.go: MaxManifestBodySize and
MaxConfigBodySize 4 MiB, MaxAuthTokenBodySize and MaxErrorBodySize 1 MiB, read with ReadAtMost,
as docker/docker_client.go fetchManifest and the config readers do).
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from diskkit.registry.partial import KEEP_AFTER
from tests.conftest import run, run_diskkit, run_launcher
from tests.distribution import start_registry
from tests.faultproxy import Fault, FaultProxy
from tests.lazyhost import random_disk

NOREG = "--tls-verify=false"
FAST = [NOREG, "--retry-delay", "0.05"]
MIB = 1 << 20


def one_line(result) -> str:
    """The whole of stderr: one line, no traceback."""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.err, result.err
    return lines[0]


def layers_of(ref: str) -> list[dict]:
    return json.loads(run("skopeo", "inspect", "--raw", NOREG, f"docker://{ref}").stdout)["layers"]


@pytest.fixture(scope="module")
def image(registry, tmp_path_factory) -> tuple[str, Path, str, int]:
    """16 MiB of random bytes in one gzip layer (over MIN_SIZE, so pulls keep partial downloads)."""
    disk = random_disk(tmp_path_factory.mktemp("trust") / "disk.img", 16 * MIB, seed=29)
    ref = f"{registry.host}/trust/genuine:v1"
    result = run_diskkit("build", NOREG, disk, "-t", ref)
    assert result.code == 0, result.err
    (layer,) = layers_of(ref)
    return ref, disk, layer["digest"], layer["size"]


def nothing_cached(cache: Path) -> bool:
    return not list((cache / "disks" / "sha256").iterdir()) and not list((cache / "refs").iterdir())


# --- size limits --------------------------------------------------------------------------------


def test_an_endless_manifest_by_tag_is_refused_at_4_mib(registry, fault_proxy, image, tmp_path):
    """Attack: a registry answers GET manifest (by tag) with a body that never ends; the launcher
    read it whole (23.7 GB until the OOM killer). Now at most 4 MiB + 1 byte is read."""
    ref = image[0]
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", "/manifests/v1", "endless", arg=256 * MIB))
    cache = tmp_path / "cache"
    result = run_launcher("pull", "--cache-dir", cache, NOREG, ref.replace(registry.host, proxy.host))
    # What the proxy managed to send: the limit plus what loopback's socket buffers took, not the 256 MiB.
    assert proxy.sent.get("/v2/trust/genuine/manifests/v1", 0) < 64 * MIB, proxy.sent
    assert result.code == 1
    line = one_line(result)
    assert "manifest v1 is larger than 4 MiB (4194304 bytes)" in line and proxy.host in line, line
    assert nothing_cached(cache)


def push_raw(host: str, repository: str, tag: str, config: bytes) -> str:
    """An image put into the registry with the plain API (skopeo and diskkit refuse to write it)."""
    import hashlib

    import requests

    def put_blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = requests.post(f"http://{host}/v2/{repository}/blobs/uploads/", timeout=30)
        location = start.headers["Location"]
        location = location if location.startswith("http") else f"http://{host}{location}"
        sep = "&" if "?" in location else "?"
        done = requests.put(f"{location}{sep}digest={digest}", data=data, headers={"Content-Type": "application/octet-stream"}, timeout=30)
        assert done.status_code == 201, done.text
        return {"digest": digest, "size": len(data)}

    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put_blob(config)},
                           "layers": []}).encode()
    done = requests.put(f"http://{host}/v2/{repository}/manifests/{tag}", data=manifest,
                        headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, timeout=30)
    assert done.status_code == 201, done.text
    return "sha256:" + hashlib.sha256(config).hexdigest()


def test_an_endless_error_body_is_refused_at_1_mib(registry, fault_proxy, image, tmp_path):
    """Attack: a 404 whose body never ends (MaxErrorBodySize is 1 MiB); it was read whole."""
    ref = image[0]
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", "/manifests/v1", "endless", arg=256 * MIB, status=404))
    result = run_diskkit("inspect", NOREG, ref.replace(registry.host, proxy.host))
    assert proxy.sent.get("/v2/trust/genuine/manifests/v1", 0) < 64 * MIB, proxy.sent
    assert result.code == 1
    assert "GET manifest is larger than 1 MiB (1048576 bytes)" in one_line(result), result.err


def test_an_endless_signature_attachment_is_refused_at_4_mib(registry, fault_proxy, image, tmp_path):
    """Attack: under a policy that requires signatures, the sigstore attachment manifest never ends
    (MaxSignatureListBodySize is 4 MiB); it was read whole before its size was checked."""
    ref = image[0]
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/sha256-[0-9a-f]{64}\.sig", "endless", arg=256 * MIB))
    key = tmp_path / "a"
    (tmp_path / "pass").write_text("pw\n")
    assert run_diskkit("generate-sigstore-key", "--output-prefix", key, "--passphrase-file", tmp_path / "pass").code == 0
    regd = tmp_path / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text("default-docker:\n  use-sigstore-attachments: true\n")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "reject"}], "transports": {"docker": {
        proxy.host: [{"type": "sigstoreSigned", "keyPath": f"{key}.pub"}]}}}))
    result = run_diskkit("inspect", NOREG, "--signature-policy", policy, "--registries.d", regd, ref.replace(registry.host, proxy.host))
    sent = sum(n for path, n in proxy.sent.items() if path.endswith(".sig"))
    assert 0 < sent < 64 * MIB, proxy.sent
    assert result.code == 1
    assert "attachment manifest is larger than 4 MiB (4194304 bytes)" in one_line(result), result.err


def test_a_config_over_4_mib_is_refused(registry, tmp_path):
    """Attack: a manifest names a config blob of 5 MiB (MaxConfigBodySize is 4 MiB); it was read whole,
    up to 64 MiB."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": {"pad": "x" * (5 * MIB)}},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    digest = push_raw(registry.host, "trust/bigconfig", "v1", config)
    ref = f"{registry.host}/trust/bigconfig:v1"
    cache = tmp_path / "cache"
    result = run_launcher("pull", "--cache-dir", cache, NOREG, ref)
    assert result.code == 1
    line = one_line(result)
    assert "over 4194304 bytes are refused" in line and digest in line, line
    result = run_diskkit("inspect", NOREG, ref)
    assert result.code == 1 and "over 4194304 bytes are refused" in one_line(result)


# --- hostile answers: one line, never a traceback ------------------------------------------------


def test_a_redirect_to_a_file_url_is_one_line(registry, fault_proxy, image, tmp_path):
    """Attack: the blob GET is redirected to file:///etc/shadow (requests' InvalidSchema, a traceback)."""
    ref, _, layer, _ = image
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", f"/blobs/{layer}", "redirect", arg="file:///etc/shadow", times=20))
    out = tmp_path / "out"
    out.mkdir()
    result = run_diskkit("copy", *FAST, f"docker://{ref.replace(registry.host, proxy.host)}", f"oci:{out / 'l'}:x")
    assert result.code == 1
    line = one_line(result)
    assert "not http(s); refused" in line and proxy.host in line, line
    assert os.listdir(out) == []
    cache = tmp_path / "cache"
    result = run_launcher("pull", "--cache-dir", cache, *FAST, ref.replace(registry.host, proxy.host))
    assert result.code == 1 and "not http(s); refused" in one_line(result)
    assert nothing_cached(cache)


def test_a_manifest_cut_mid_body_is_one_line(registry, fault_proxy, image, tmp_path):
    """Attack: the manifest's body ends before its Content-Length (requests' ChunkedEncodingError)."""
    ref = image[0]
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", "/manifests/", "truncate", arg=100, times=50))
    out = tmp_path / "out"
    out.mkdir()
    result = run_diskkit("copy", *FAST, f"docker://{ref.replace(registry.host, proxy.host)}", f"oci:{out / 'l'}:x")
    assert result.code == 1
    line = one_line(result)
    assert "body was cut short" in line and "manifest" in line, line
    assert os.listdir(out) == []


@pytest.mark.parametrize("fault", [
    Fault("GET", "/manifests/", "status", arg=200, times=50),  # `{"errors": []}` as the manifest: a KeyError
    Fault("GET", "/manifests/", "redirect", arg="http://[::1", times=50),  # urllib's ValueError
], ids=["json-without-config", "redirect-to-a-bad-url"])
def test_a_hostile_manifest_answer_is_one_line(registry, fault_proxy, image, tmp_path, fault):
    """Attacks: answers the proxy makes up in place of the manifest ended in tracebacks."""
    ref = image[0]
    proxy = fault_proxy(registry)
    proxy.add(fault)
    out = tmp_path / "out"
    out.mkdir()
    via = ref.replace(registry.host, proxy.host)
    result = run_diskkit("copy", *FAST, f"docker://{via}", f"oci:{out / 'l'}:x")
    assert result.code == 1
    assert proxy.host in one_line(result)
    assert os.listdir(out) == []
    cache = tmp_path / "cache"
    result = run_launcher("pull", "--cache-dir", cache, *FAST, via)
    assert result.code == 1 and proxy.host in one_line(result)
    assert nothing_cached(cache)


def invalid_deflate_at(host: str, repository: str, layer: str) -> int:
    """A byte of the layer whose flipped bit makes ISA-L find an invalid deflate block (IsalError)."""
    import io

    import requests
    from isal import igzip, isal_zlib

    head = requests.get(f"http://{host}/v2/{repository}/blobs/{layer}", headers={"Range": "bytes=0-262143"}, timeout=30).content
    for at in range(10, 4096):
        bad = bytearray(head)
        bad[at] ^= 1
        try:
            igzip.IGzipFile(fileobj=io.BytesIO(bytes(bad))).read(1 << 20)
        except isal_zlib.error:
            return at
        except (OSError, EOFError):
            continue
    raise AssertionError("no bit of the first 4 KiB makes an invalid deflate block")


def test_a_corrupt_gzip_layer_is_one_line(registry, fault_proxy, image, tmp_path):
    """Attack: a flipped bit early in the layer's deflate stream (ISA-L's IsalError, a traceback)."""
    ref, _, layer, _ = image
    proxy = fault_proxy(registry)
    # The whole layer's GETs: its lazy TOC, read first with a range, stays intact.
    proxy.add(Fault("GET", f"/blobs/{layer}", "flip", arg=invalid_deflate_at(registry.host, "trust/genuine", layer), times=20, header=("Range", None)))
    cache = tmp_path / "cache"
    result = run_launcher("pull", "--cache-dir", cache, *FAST, ref.replace(registry.host, proxy.host))
    assert result.code == 1
    line = one_line(result)
    assert "gzip stream cannot be decompressed" in line and layer[:19] in line, line
    assert nothing_cached(cache)


# --- partial downloads are tied to their source --------------------------------------------------


def lie_then_cut(proxy, layer: str, size: int) -> None:
    """The liar: serves the layer with one bit wrong, and stops half way, after a while (so the pull keeps
    what came after its first partial.KEEP_AFTER seconds)."""
    proxy.add(Fault("GET", f"/blobs/{layer}", "flip", arg=size // 2 - 100, stop_at=size // 2, header=("Range", None),
                    hold=(size // 4, KEEP_AFTER + 0.5)))


def pulled_by_liar(cache: Path, proxy, ref: str, layer: str, size: int) -> None:
    result = run_launcher("pull", "--cache-dir", cache, NOREG, "--retry-times", "0", ref)
    assert result.code == 1, result.err
    kept = cache / "partial" / f"{layer.replace(':', '-')}.part"
    assert kept.stat().st_size > size // 2 - 100 and kept.stat().st_blocks * 512 < size // 2, "the liar's bytes (with the wrong one) are kept"


def test_a_liars_partial_is_not_resumed_by_the_genuine_registry(registry, fault_proxy, image, tmp_path):
    """Attack: a liar serves wrong bytes under the genuine layer's digest and is cut off; the
    `partial/<digest>.part` it left was resumed by every later pull of the genuine image, which
    failed (with a traceback) until gc. A partial is now resumed only from the source it came from."""
    ref, disk, layer, size = image
    proxy = fault_proxy(registry)
    lie_then_cut(proxy, layer, size)
    cache = tmp_path / "cache"
    pulled_by_liar(cache, proxy, ref.replace(registry.host, proxy.host), layer, size)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", ref)
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()
    assert list((cache / "partial").iterdir()) == []


def test_a_resumed_blob_that_fails_its_digest_restarts_from_zero_once(registry, fault_proxy, image, tmp_path):
    """Attack: the same source lies, is cut off, then answers honestly: the resumed blob fails its
    digest. The kept bytes are discarded and the pull starts again from byte 0, and succeeds."""
    ref, disk, layer, size = image
    proxy = fault_proxy(registry)
    via = ref.replace(registry.host, proxy.host)
    lie_then_cut(proxy, layer, size)
    cache = tmp_path / "cache"
    pulled_by_liar(cache, proxy, via, layer, size)
    before = len(proxy.log)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", via)
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()
    gets = [status for method, path, status in proxy.log[before:] if method == "GET" and path.endswith(f"/blobs/{layer}")]
    # The lazy TOC's range, the bytes before the kept ones and the rest after them; then the TOC's range
    # again and the whole blob once.
    assert gets == [206, 206, 206, 206, 200], gets
    assert list((cache / "partial").iterdir()) == []


# --- private caches (issue 26 item 2) ------------------------------------------------------------

NOBODY = 65534
READ_ALL = ("import os, sys\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        os.close(os.open(path, os.O_RDONLY)); print(path)\n"
            "    except OSError:\n"
            "        pass\n")


def readable_by(uid: int, gid: int, files: list[Path], groups: str = "--clear-groups") -> list[str]:
    """Which of `files` the user can open, tried by a process of that user (setpriv)."""
    import subprocess
    import sys

    done = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", groups, sys.executable, "-c", READ_ALL, *map(str, files)],
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()]


@pytest.fixture
def scratch():
    from tests.vmhost import qemu_scratch

    with qemu_scratch("trust-") as root:  # world-traversable, as /var/lib is
        yield root


def test_a_root_cache_is_private_to_root_and_qemu(registry, fault_proxy, image, scratch):
    """Attack: another local user reads the disks root pulled (0444 files in 0755 directories) and
    the partial download of a private image. Now a cache root makes is closed to them, and to qemu's
    users too (libvirt's system daemon's, KubeVirt's 107): a VM's qemu is handed the disks it uses
    open (launcher.runtime.diskfds), and reads no other image's by name."""
    import grp
    import pwd

    ref, disk, layer, size = image
    cache = scratch / "var-lib-diskkit"
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", ref)
    assert pulled.code == 0, pulled.err
    path = Path(json.loads(pulled.out)["path"])
    # A second image's download, cut half way: its partial stays.
    second = random_disk(scratch / "second.img", 16 * MIB, seed=30)
    assert run_diskkit("build", NOREG, second, "-t", f"{registry.host}/trust/second:v1").code == 0
    (other,) = layers_of(f"{registry.host}/trust/second:v1")
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", f"/blobs/{other['digest']}", "truncate", arg=other["size"] // 2, header=("Range", None)))  # not the lazy TOC's range
    cut = run_launcher("pull", "--cache-dir", cache, NOREG, "--retry-times", "0", f"{proxy.host}/trust/second:v1")
    assert cut.code == 1, cut.err
    files = cache_files(cache)
    assert path in files and any(p.suffix == ".part" for p in files), files
    assert readable_by(NOBODY, NOBODY, files) == []
    qemu = pwd.getpwnam("libvirt-qemu")
    assert readable_by(qemu.pw_uid, grp.getgrnam("libvirt-qemu").gr_gid, [path], "--init-groups") == []
    assert readable_by(107, pwd.getpwuid(107).pw_gid, [path]) == [] and readable_by(107, 107, [path]) == []
    assert oct(cache.stat().st_mode & 0o777) == "0o711" and oct((cache / "run").stat().st_mode & 0o777) == "0o711"
    assert run_launcher("ls", "--cache-dir", cache).err == ""  # a fresh cache: no warning


def test_a_users_cache_is_private_to_that_user(registry, image, scratch):
    """Attack: another local user reads what an unprivileged user pulled into ~/.cache/diskkit."""
    import pwd

    ref, _, _, _ = image
    home = scratch / "home"
    home.mkdir()
    gid = pwd.getpwuid(107).pw_gid
    os.chown(home, 107, gid)
    cache = home / ".cache" / "diskkit"
    pulled = run_launcher("pull", NOREG, "--json", ref, user="107",
                          env={"HOME": str(home), "XDG_CACHE_HOME": "", "DISKKIT_CACHE": ""})
    assert pulled.code == 0, pulled.err
    path = Path(json.loads(pulled.out)["path"])
    assert path.is_relative_to(cache)
    files = cache_files(cache)
    assert path in files
    assert readable_by(NOBODY, NOBODY, files) == []
    assert readable_by(107, gid, [path]) == [str(path)]
    assert oct(cache.stat().st_mode & 0o777) == "0o700"


def test_an_existing_open_cache_gets_a_warning(scratch):
    """A cache made before caches were private (0755 throughout) is named by `ls` and `gc`, once."""
    cache = scratch / "old"
    for sub in ("", "disks", "blobs", "partial"):
        (cache / sub).mkdir(exist_ok=True)
        (cache / sub).chmod(0o755)
    for command in ("ls", "gc"):
        result = run_launcher(command, "--cache-dir", cache)
        assert result.code == 0, result.err
        line = one_line(result)
        assert "warning" in line and f"{cache}," in line and f"{cache / 'disks'}" in line and "other local users" in line, line


def test_a_root_caches_lazy_exports_are_private_and_its_sockets_reachable(registry, scratch):
    """Attack: another local user reads lazy/*/disk.img and members.gz of what the root disk server
    serves. They are closed to it now, while the server's sockets in serve/ stay reachable to
    other users' launchers (a control request as KubeVirt's qemu, 107, gets its own NBD socket)."""
    import subprocess
    import sys

    from tests.lazyhost import control, disk_server

    ref = f"{registry.host}/trust/lazy:toc"
    assert run_diskkit("build", NOREG, "--lazy", random_disk(scratch / "lazy.img", 4 * MIB, seed=31), "-t", ref).code == 0
    cache = scratch / "served"
    with disk_server(cache):
        opened = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}, "clients": 0})
        assert opened.get("ok"), opened
        files = cache_files(cache / "lazy")
        assert any(p.name == "disk.img" for p in files), files
        assert readable_by(NOBODY, NOBODY, cache_files(cache)) == []
        code = ("import json, sys; from pathlib import Path; from launcher.diskserver.control import request; "
                "print(json.dumps(request(Path(sys.argv[1]), json.loads(sys.argv[2]))))")
        req = {"op": "open", "image": ref, "registry": {"tls_verify": False}, "clients": 0}
        # KubeVirt's qemu user in its own group, which the control socket is open to (launcher serve --socket-group's default).
        qemu_gid = pwd.getpwuid(107).pw_gid
        asked = subprocess.run(["setpriv", "--reuid=107", f"--regid={qemu_gid}", "--clear-groups", sys.executable, "-c", code,
                                str(cache / "serve" / "control.sock"), json.dumps(req)], capture_output=True, text=True)
        assert asked.returncode == 0, asked.stderr
        assert json.loads(asked.stdout)["socket"] == str(cache / "serve" / "nbd-107.sock")


def test_an_endless_token_answer_is_refused_at_1_mib(tmp_path):
    """Attack: the token service a registry names answers with a body that never ends
    (MaxAuthTokenBodySize is 1 MiB, containers/image internal/iolimits/iolimits.go); it was read whole.
    The real registry names a realm behind the lying proxy, in front of the real token issuer."""
    proxies: list[FaultProxy] = []

    def via(issuer: str) -> str:
        proxies.append(FaultProxy(issuer))
        return proxies[-1].url("/token")

    registry = start_registry(tmp_path / "registry", auth="token", realm_via=via)
    [proxy] = proxies
    try:
        proxy.add(Fault("GET", "/token", "endless", arg=256 * MIB))
        result = run_diskkit("inspect", NOREG, "--creds", f"{registry.username}:{registry.password}", f"{registry.host}/trust/any:v1")
        sent = sum(n for path, n in proxy.sent.items() if path.startswith("/token"))
        assert 0 < sent < 64 * MIB, proxy.sent
        assert result.code == 1
        line = one_line(result)
        assert f"token service {proxy.url('/token')} answer is larger than 1 MiB (1048576 bytes)" in line, line
    finally:
        registry.stop()
        proxy.close()
