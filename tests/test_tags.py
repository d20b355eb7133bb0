"""Every -t of a build is written (issue 32 item 1), and any other option that takes one value refuses
to be given twice instead of keeping the last, on both command lines."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import run, run_launcher
from tests.test_registry import INSECURE, repo


def _digest(ref: str) -> str | None:
    proc = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{ref}"], capture_output=True)
    if proc.returncode != 0:
        return None
    return "sha256:" + __import__("hashlib").sha256(proc.stdout).hexdigest()


def test_every_tag_of_a_build_is_pushed_with_the_layer_sent_once(diskkit, registry, fault_proxy, qcow2):
    proxy = fault_proxy(registry)  # forwards everything; its log counts the requests
    name = repo(registry).split("/", 1)[1]
    tags = [f"{proxy.host}/{name}:{t}" for t in ("40-2611251200", "40", "latest")]
    result = diskkit("build", qcow2, *[a for t in tags for a in ("-t", t)], INSECURE, "--json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert [d["reference"] for d in out["destinations"]] == [f"docker://{t}" for t in tags]
    assert [d["status"] for d in out["destinations"]] == ["pushed", "tagged", "tagged"]
    assert {_digest(t.replace(proxy.host, registry.host)) for t in tags} == {out["digest"]}
    puts = [path for method, path, _ in proxy.log if method == "PUT" and "/manifests/" in path]
    assert puts == [f"/v2/{name}/manifests/{t}" for t in ("40-2611251200", "40", "latest")]  # one manifest PUT per tag
    layer = out["layers"][0]["digest"]
    sent_with_layer = [path for method, path, _ in proxy.log if method == "PUT" and "/blobs/uploads/" in path and layer in path]
    assert len(sent_with_layer) == 1  # the layer went up once


def test_tags_in_a_registry_and_a_layout_get_the_same_image(diskkit, registry, qcow2, tmp_path):
    target = f"{repo(registry)}:v1"
    layout = f"oci:{tmp_path / 'layout'}:v1"
    result = diskkit("build", qcow2, "-t", target, "-t", layout, INSECURE)
    assert result.code == 0, result.err
    assert _digest(target) == result.last_line
    inspected = json.loads(run("skopeo", "inspect", layout).stdout)
    assert inspected["Digest"] == result.last_line
    assert f"{layout}: copied {result.last_line}" in result.err


def test_a_destination_that_refuses_the_push_stops_the_build_before_any_tag(diskkit, registry, auth_registry, qcow2):
    open_target = f"{repo(registry)}:v1"
    tls = ["--cert-dir", str(auth_registry.ca_dir)] if auth_registry.tls else []
    closed_target = f"{repo(auth_registry)}:v1"
    result = diskkit("build", qcow2, "-t", open_target, "-t", closed_target, INSECURE if not tls else "--tls-verify=true", *tls)
    assert result.code == 6  # Exit.AUTH
    assert auth_registry.host in result.err and len(result.err.strip().splitlines()) == 1
    assert _digest(open_target) is None  # nothing was written to the reachable one either


def test_a_destination_named_twice_is_refused(diskkit, qcow2, tmp_path):
    layout = f"oci:{tmp_path / 'layout'}:v1"
    result = diskkit("build", qcow2, "-t", layout, "-t", layout)
    assert result.code == 1
    assert result.err.strip() == f"diskkit: -t {layout}: named twice"
    assert not (tmp_path / "layout").exists()


def test_a_repeated_single_value_option_is_an_error_on_both_clis(diskkit, qcow2, tmp_path):
    layout = f"oci:{tmp_path / 'layout'}:v1"
    twice = diskkit("build", qcow2, "-t", layout, "--format", "raw", "--format", "qcow2")
    assert twice.code == 2
    assert twice.err.strip() == "diskkit: --format: given more than once; it takes one value (the last one would silently win)"
    assert not (tmp_path / "layout").exists()
    labels = diskkit("build", qcow2, "-t", layout, "--label", "a=1", "--label", "b=2")  # repeatable ones still are
    assert labels.code == 0, labels.err
    vmi = tmp_path / "vmi.yaml"
    vmi.write_text("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: x}\nspec: {domain: {devices: {}}}\n")
    waits = run_launcher("run", vmi, "--wait-for", "login:", "--wait-for", "# ")
    assert waits.code == 2
    assert waits.err.strip().startswith("launcher: --wait-for: given more than once")
    nested = run_launcher("dv", "token", "--namespace", "a", "--namespace", "b", "x")
    assert nested.code == 2 and "--namespace: given more than once" in nested.err, nested.err


def test_each_tag_of_a_signed_build_carries_a_signature_for_its_reference(diskkit, registry, qcow2, tmp_path):
    from tests.test_signing import attachment, blob

    keys = tmp_path / "ci"
    (tmp_path / "pass").write_text("pw\n")
    assert diskkit("generate-sigstore-key", "--output-prefix", keys, "--passphrase-file", tmp_path / "pass").code == 0
    regd = tmp_path / "registries.d"
    regd.mkdir()
    (regd / "default.yaml").write_text("default-docker:\n  use-sigstore-attachments: true\n")
    name = repo(registry).split("/", 1)[1]
    tags = [f"{registry.host}/{name}:{t}" for t in ("a", "b")]
    result = diskkit("build", qcow2, "-t", tags[0], "-t", tags[1], INSECURE, "--registries.d", regd, "--sign-by-sigstore-private-key", f"{keys}.private",
                     "--sign-passphrase-file", tmp_path / "pass")
    assert result.code == 0, result.err
    manifest = attachment(registry, name, result.last_line)
    identities = sorted(json.loads(blob(registry, name, layer["digest"]))["critical"]["identity"]["docker-reference"] for layer in manifest["layers"])
    assert identities == sorted(tags)
    for tag in tags:
        checked = diskkit("verify", INSECURE, "--key", f"{keys}.pub", tag)
        assert checked.code == 0 and "signed by" in checked.out, checked.err
