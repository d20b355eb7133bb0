"""Push, pull and copy against the real distribution registry, with auth, TLS, and real peers."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import uuid

from tests.conftest import make_qcow2, run

INSECURE = "--tls-verify=false"


def repo(registry, name: str = "disks") -> str:
    return f"{registry.host}/{name}-{uuid.uuid4().hex[:8]}"


def skopeo_inspect(ref: str, *flags: str, raw: bool = False) -> dict:
    return json.loads(run("skopeo", "inspect", *flags, *(["--raw"] if raw else []), ref).stdout)


def test_build_streams_to_a_registry_with_the_local_digest(diskkit, registry, qcow2, tmp_path):
    target = f"{repo(registry)}:v1"
    local = diskkit("build", qcow2, "-t", f"oci:{tmp_path / 'l'}")
    pushed = diskkit("build", qcow2, "-t", target, INSECURE)  # bare HOST/REPO:TAG means docker://
    assert pushed.code == 0, pushed.err
    assert pushed.last_line == local.last_line
    info = skopeo_inspect(f"docker://{target}", "--tls-verify=false")
    assert info["Digest"] == pushed.last_line
    # skopeo pulls it, checking every digest, and our verify agrees with the copy.
    run("skopeo", "copy", "--src-tls-verify=false", f"docker://{target}", f"oci:{tmp_path / 'copy'}:x")
    assert diskkit("verify", f"oci:{tmp_path / 'copy'}:x").code == 0
    assert diskkit("verify", INSECURE, target).code == 0


def test_push_between_every_transport_skips_and_mounts(diskkit, registry, qcow2, tmp_path):
    layout = f"oci:{tmp_path / 'layout'}:v1"
    digest = diskkit("build", qcow2, "-t", layout).last_line
    first, second = f"docker://{repo(registry)}:a", f"docker://{repo(registry)}:b"
    up = diskkit("push", INSECURE, "--json", layout, first)
    assert up.code == 0, up.err
    assert json.loads(up.out)["digest"] == digest
    assert set(json.loads(up.out)["blobs"].values()) == {"uploaded"}
    again = json.loads(diskkit("push", INSECURE, "--json", layout, first).out)
    assert set(again["blobs"].values()) == {"skipped"}
    mounted = json.loads(diskkit("push", INSECURE, "--json", first, second).out)
    assert set(mounted["blobs"].values()) == {"mounted"}
    # Back down into each local transport, then check with an independent reader.
    for dest in (f"oci:{tmp_path / 'down'}:x", f"oci-archive:{tmp_path / 'down.tar'}:x", f"docker-archive:{tmp_path / 'd.tar'}:down/x:1"):
        result = diskkit("push", INSECURE, second, dest)
        assert result.code == 0, result.err
        run("skopeo", "inspect", dest)
        assert diskkit("verify", dest).code == 0
    # A docker-archive goes up with its plain layers and stays valid.
    assert diskkit("push", INSECURE, f"docker-archive:{tmp_path / 'd.tar'}", f"{repo(registry)}:fromarchive").code == 0


def test_inspect_remote_reads_no_layer_blob(diskkit, registry, qcow2, fault_proxy):
    target = f"{repo(registry)}:v1"
    assert diskkit("build", qcow2, "-t", target, INSECURE).code == 0
    proxy = fault_proxy(registry)
    result = diskkit("inspect", INSECURE, "--json", target.replace(registry.host, proxy.host))
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["disk"]["path"] == "/disk/disk.qcow2" and out["disk"]["virtualSize"] == 64 << 20
    blob_gets = [path for method, path, _ in proxy.log if method == "GET" and "/blobs/" in path]
    assert blob_gets == [f"/v2/{target.split('/', 1)[1].split(':')[0]}/blobs/{out['config']['digest']}"]


def test_tls_needs_the_private_ca(diskkit, tls_registry, qcow2):
    target = f"{repo(tls_registry)}:v1"
    refused = diskkit("build", qcow2, "-t", target)
    assert refused.code == 1 and "TLS verification failed" in refused.err and "--cert-dir" in refused.err
    ok = diskkit("build", qcow2, "-t", target, "--cert-dir", tls_registry.ca_dir)
    assert ok.code == 0, ok.err
    assert diskkit("verify", "--cert-dir", tls_registry.ca_dir, target).code == 0
    assert diskkit("inspect", INSECURE, target).code == 0
    skopeo_inspect(f"docker://{target}", "--cert-dir", str(tls_registry.ca_dir))


def test_basic_auth_from_creds_and_auth_files(diskkit, auth_registry, qcow2, tmp_path):
    reg = auth_registry
    tls = ["--cert-dir", str(reg.ca_dir)] if reg.tls else [INSECURE]
    target = f"{repo(reg)}:v1"
    denied = diskkit("build", qcow2, "-t", target, *tls)
    assert denied.code == 6  # Exit.AUTH
    assert reg.host in denied.err and "denied" in denied.err
    wrong = diskkit("build", qcow2, "-t", target, *tls, "--creds", f"{reg.username}:not-{reg.password}")
    assert wrong.code == 6 and reg.password not in wrong.err and "not-" not in wrong.err
    ok = diskkit("build", qcow2, "-t", target, *tls, "--creds", f"{reg.username}:{reg.password}")
    assert ok.code == 0, ok.err
    auth = reg.auth_file(tmp_path / "auth.json")
    assert diskkit("verify", *tls, "--authfile", auth, target).code == 0
    assert diskkit("verify", *tls, target, env={"REGISTRY_AUTH_FILE": str(auth)}).code == 0
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    (home / ".docker" / "config.json").write_text(auth.read_text())
    assert diskkit("inspect", *tls, target, env={"HOME": str(home), "XDG_RUNTIME_DIR": str(tmp_path / "none")}).code == 0
    run("skopeo", "inspect", *(["--cert-dir", str(reg.ca_dir)] if reg.tls else ["--tls-verify=false"]), "--authfile", auth, f"docker://{target}")


def test_credential_helper_protocol(diskkit, auth_registry, qcow2, tmp_path):
    reg = auth_registry
    tls = ["--cert-dir", str(reg.ca_dir)] if reg.tls else [INSECURE]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "docker-credential-diskkittest"
    asked = tmp_path / "asked"
    helper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = get ] || exit 1\ncat > {asked}\n'
        f"echo '{{\"ServerURL\":\"{reg.host}\",\"Username\":\"{reg.username}\",\"Secret\":\"{reg.password}\"}}'\n"
    )
    helper.chmod(helper.stat().st_mode | stat.S_IEXEC)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {}, "credHelpers": {reg.host: "diskkittest"}}))
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "REGISTRY_AUTH_FILE": str(config)}
    result = diskkit("build", qcow2, "-t", f"{repo(reg)}:v1", *tls, env=env)
    assert result.code == 0, result.err
    assert asked.read_text() == reg.host
    store = tmp_path / "store.json"
    store.write_text(json.dumps({"credsStore": "diskkittest"}))
    assert diskkit("build", qcow2, "-t", f"{repo(reg)}:v2", *tls, env={**env, "REGISTRY_AUTH_FILE": str(store)}).code == 0


def test_token_auth_scopes_and_reuse(diskkit, token_registry, qcow2):
    reg = token_registry
    target = f"{repo(reg)}:v1"
    anonymous = diskkit("build", qcow2, "-t", target, INSECURE)
    assert anonymous.code == 6 and "denied" in anonymous.err
    before = len(reg.token_requests)
    ok = diskkit("build", qcow2, "-t", target, INSECURE, "--creds", f"{reg.username}:{reg.password}")
    assert ok.code == 0, ok.err
    asked = reg.token_requests[before:]
    name = target.split("/", 1)[1].split(":")[0]
    assert any(f"repository:{name}:pull,push" in r["scope"] for r in asked)
    assert all(r["user"] == reg.username for r in asked)
    assert len(asked) <= 2  # one token per scope, reused across every blob and manifest request
    # Anonymous pull is allowed by this issuer: tokens with pull scope only.
    assert diskkit("verify", INSECURE, target).code == 0


def test_buildah_docker_image_and_manifest_list_are_pulled_and_verified(diskkit, registry, tmp_path):
    disk = make_qcow2(tmp_path / "vm.qcow2", size="8M")
    env = {**os.environ, "STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}
    storage = ["--root", str(tmp_path / "storage"), "--runroot", str(tmp_path / "run")]
    name = repo(registry, "buildah")

    def buildah(*args):
        return subprocess.run(["buildah", *storage, *args], check=True, capture_output=True, text=True, env=env).stdout.strip()

    images = []
    for arch in ("amd64", "arm64"):
        ctr = buildah("from", "--arch", arch, "scratch")
        buildah("copy", "--chown", "107:107", ctr, str(disk), "/disk/")
        buildah("config", "--arch", arch, "--os", "linux", ctr)
        image = f"localhost/vm-{arch}:latest"
        buildah("commit", "--format", "docker", ctr, image)
        images.append(image)
    single = f"{name}:single"
    buildah("push", "--tls-verify=false", images[0], f"docker://{single}")
    manifest = skopeo_inspect(f"docker://{single}", "--tls-verify=false", raw=True)
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    result = diskkit("verify", INSECURE, "--json", single)
    assert result.code == 0, result.out
    assert json.loads(result.out)["disk"]["path"] == "/disk/vm.qcow2"

    buildah("manifest", "create", "localhost/vm-list")
    for image in images:
        buildah("manifest", "add", "localhost/vm-list", image)
    buildah("manifest", "push", "--all", "--format", "v2s2", "--tls-verify=false", "localhost/vm-list", f"docker://{name}:list")
    listed = skopeo_inspect(f"docker://{name}:list", "--tls-verify=false", raw=True)
    assert listed["mediaType"] == "application/vnd.docker.distribution.manifest.list.v2+json"
    arm = diskkit("push", INSECURE, "--platform", "linux/arm64", f"docker://{name}:list", f"oci:{tmp_path / 'arm'}:x")
    assert arm.code == 0, arm.err
    assert skopeo_inspect(f"oci:{tmp_path / 'arm'}:x")["Architecture"] == "arm64"
    assert diskkit("verify", INSECURE, "--platform", "linux/amd64", f"{name}:list").code == 0
    everything = diskkit("push", INSECURE, "--all", f"docker://{name}:list", f"oci:{tmp_path / 'all'}:x")
    assert everything.code == 0, everything.err
    # Layouts index OCI types only, so the list and its manifests are restated as OCI, as skopeo does.
    index = skopeo_inspect(f"oci:{tmp_path / 'all'}:x", raw=True)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert {m["mediaType"] for m in index["manifests"]} == {"application/vnd.oci.image.manifest.v1+json"}
    assert sorted(m["platform"]["architecture"] for m in index["manifests"]) == ["amd64", "arm64"]
    assert diskkit("verify", "--platform", "linux/arm64", f"oci:{tmp_path / 'all'}:x").code == 0


def test_skopeo_pushed_layout_is_pulled_by_ours(diskkit, registry, qcow2, tmp_path):
    assert diskkit("build", qcow2, "--compression", "zstd", "-t", f"oci:{tmp_path / 'l'}:z").code == 0
    target = f"{repo(registry)}:z"
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{tmp_path / 'l'}:z", f"docker://{target}")
    assert diskkit("push", INSECURE, target, f"oci:{tmp_path / 'back'}:z").code == 0
    assert diskkit("verify", f"oci:{tmp_path / 'back'}:z").code == 0


def test_multi_platform_build_pushes_an_index(diskkit, registry, tmp_path):
    x86 = make_qcow2(tmp_path / "x86.qcow2", pattern=1)
    arm = make_qcow2(tmp_path / "arm.qcow2", pattern=2)
    target = f"{repo(registry)}:multi"
    result = diskkit("build", "--platform", f"linux/amd64={x86}", "--platform", f"linux/arm64={arm}", "-t", target, INSECURE, "--json")
    assert result.code == 0, result.err
    index = skopeo_inspect(f"docker://{target}", "--tls-verify=false", raw=True)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert [(m["platform"]["os"], m["platform"]["architecture"]) for m in index["manifests"]] == [("linux", "amd64"), ("linux", "arm64")]
    for arch in ("amd64", "arm64"):
        info = skopeo_inspect(f"docker://{target}", "--tls-verify=false", "--override-arch", arch)
        assert info["Architecture"] == arch
        checked = diskkit("verify", INSECURE, "--json", "--platform", f"linux/{arch}", target)
        assert json.loads(checked.out)["disk"]["path"] == f"/disk/{'x86' if arch == 'amd64' else 'arm'}.qcow2"


def test_delete(diskkit, registry, qcow2):
    target = f"{repo(registry)}:gone"
    digest = diskkit("build", qcow2, "-t", target, INSECURE).last_line
    result = diskkit("delete", INSECURE, f"docker://{target}")
    assert result.code == 0 and result.last_line == digest
    missing = diskkit("inspect", INSECURE, target)
    assert missing.code == 5 and "not found" in missing.err  # Exit.NOT_FOUND
