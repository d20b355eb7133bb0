"""containerDisk.imagePullSecret (issue 30 item 6): the Secret in --manifests gives that image's pulls
their credentials, as the kubelet uses the pull secrets KubeVirt puts on the pod
(kubevirt pkg/virt-controller/services/rendervolumes.go); against the real registry with basic auth."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import yaml

from tests.conftest import run_diskkit, run_launcher
from tests.test_registry import INSECURE, repo


def _vmi(image: str, secret: str | None) -> dict:
    disk = {"image": image, **({"imagePullSecret": secret} if secret else {})}
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "pullsecret", "namespace": "vms"},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                 "volumes": [{"name": "root", "containerDisk": disk}]},
    }


def _secret(name: str, host: str, user: str, password: str, kind: str = "kubernetes.io/dockerconfigjson") -> dict:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    auths = {host: {"auth": auth}}
    key, config = (".dockerconfigjson", {"auths": auths}) if kind.endswith("dockerconfigjson") else (".dockercfg", auths)
    return {"apiVersion": "v1", "kind": "Secret", "type": kind, "metadata": {"name": name, "namespace": "vms"},
            "data": {key: base64.b64encode(json.dumps(config).encode()).decode()}}


def test_image_pull_secret_from_manifests_is_used_for_that_image(diskkit, auth_registry, qcow2, tmp_path):
    reg = auth_registry
    image = f"{repo(reg)}:v1"
    assert diskkit("build", qcow2, "-t", image, INSECURE, "--creds", f"{reg.username}:{reg.password}").code == 0
    manifests = tmp_path / "k8s"
    manifests.mkdir()
    vmi_file = tmp_path / "vmi.yaml"

    def domain(secret: str | None, cache: str):
        vmi_file.write_text(yaml.safe_dump(_vmi(image, secret)))
        return run_launcher("domain", "--cache-dir", tmp_path / cache, "--manifests", manifests, "--no-lazy", INSECURE, vmi_file,
                            env={"REGISTRY_AUTH_FILE": str(tmp_path / "none.json"), "HOME": str(tmp_path)})

    (tmp_path / "none.json").write_text("{}")
    denied = domain(None, "c0")
    assert denied.code == 6 and "HTTP 401" in denied.err, denied.err  # Exit.AUTH
    (manifests / "wrong.yaml").write_text(yaml.safe_dump(_secret("wrong", reg.host, reg.username, "not-it")))
    refused = domain("wrong", "c1")
    assert refused.code == 6 and "denied for user" in refused.err, refused.err
    (manifests / "pull.yaml").write_text(yaml.safe_dump(_secret("pull", reg.host, reg.username, reg.password)))
    pulled = domain("pull", "c2")
    assert pulled.code == 0, pulled.err
    assert "<domain" in pulled.out
    (manifests / "legacy.yaml").write_text(yaml.safe_dump(_secret("legacy", reg.host, reg.username, reg.password, "kubernetes.io/dockercfg")))
    assert domain("legacy", "c3").code == 0
    missing = domain("absent-" + uuid.uuid4().hex[:6], "c4")  # the kubelet warns and pulls without it
    assert missing.code == 6 and "HTTP 401" in missing.err, missing.err
    assert missing.err.startswith("launcher: spec.volumes[0].containerDisk.image: ")
    assert missing.err.strip().endswith("in namespace vms in --manifests; pulling with this node's credentials"), missing.err


def test_image_pull_secret_is_used_on_the_lazy_path(auth_registry, tmp_path):
    """The default (lazy) path: `launcher domain` of a lazy private image asks the node's disk server
    with the volume's pull secret, as the kubelet pulls with the pod's (it got the registry's 401: the
    client sent only the node's credentials). The secret serves that request alone: another user in
    the control socket's group asking for the same image, already exported, still gets the 401."""
    from tests.lazyhost import disk_server, random_disk
    from tests.test_trust_diskserver import _as_other_user
    from tests.vmhost import qemu_scratch

    reg = auth_registry
    image = f"{repo(reg)}:v1"
    built = run_diskkit("build", "--lazy", INSECURE, "--creds", f"{reg.username}:{reg.password}", random_disk(tmp_path / "d.img", 1 << 20), "-t", image)
    assert built.code == 0, built.err
    manifests = tmp_path / "k8s"
    manifests.mkdir()
    (manifests / "pull.yaml").write_text(yaml.safe_dump(_secret("pull", reg.host, reg.username, reg.password)))
    vmi_file = tmp_path / "vmi.yaml"
    env = {"REGISTRY_AUTH_FILE": str(tmp_path / "none.json"), "HOME": str(tmp_path)}
    (tmp_path / "none.json").write_text("{}")
    with qemu_scratch("pullsecret-") as shared:
        cache = shared / "cache"
        cache.mkdir()
        with disk_server(cache):  # the node's server, with no credentials of its own
            for secret, code in ((None, 6), ("pull", 0)):
                vmi_file.write_text(yaml.safe_dump(_vmi(image, secret)))
                shown = run_launcher("domain", "--cache-dir", cache, "--manifests", manifests, INSECURE, vmi_file, env=env)
                assert shown.code == code, shown.err
            assert "<domain" in shown.out and "nbd" in shown.out, shown.out
            other = _as_other_user(cache, {"op": "open", "image": image, "registry": {"tls_verify": False}})
            assert not other["ok"] and "HTTP 401" in other["error"], other


def test_a_cached_private_image_is_served_only_to_credentials_that_could_pull_it(diskkit, auth_registry, qcow2, tmp_path):
    """Attack: an image pulled with one VMI's pull secret was a cache hit for every later VMI on the node,
    with no credentials of its own. As the kubelet's "ensure secret pulled images"
    (keps/sig-node/2535-ensure-secret-pulled-images), a hit is served to credentials it was pulled or
    proved with; others read its manifest from the registry first, and a refusal is the registry's 401."""
    reg = auth_registry
    image = f"{repo(reg)}:v1"
    assert diskkit("build", qcow2, "-t", image, INSECURE, "--creds", f"{reg.username}:{reg.password}").code == 0
    manifests = tmp_path / "k8s"
    manifests.mkdir()
    (manifests / "pull.yaml").write_text(yaml.safe_dump(_secret("pull", reg.host, reg.username, reg.password)))
    (manifests / "wrong.yaml").write_text(yaml.safe_dump(_secret("wrong", reg.host, reg.username, "not-it")))
    vmi_file = tmp_path / "vmi.yaml"
    (tmp_path / "none.json").write_text("{}")
    node_auth = reg.auth_file(tmp_path / "node.json")

    def domain(secret: str | None, authfile: Path, *lazy):
        vmi_file.write_text(yaml.safe_dump(_vmi(image, secret)))
        return run_launcher("domain", "--cache-dir", tmp_path / "cache", "--manifests", manifests, *lazy, INSECURE, vmi_file,
                            env={"REGISTRY_AUTH_FILE": str(authfile), "HOME": str(tmp_path)})

    assert domain("pull", tmp_path / "none.json", "--no-lazy").code == 0  # pulled with the secret
    for secret, lazy in ((None, ["--no-lazy"]), (None, []), ("wrong", ["--no-lazy"])):
        refused = domain(secret, tmp_path / "none.json", *lazy)
        assert refused.code == 6, refused.err
        [line] = refused.err.strip().splitlines()
        assert "pulled with other credentials" in line and "HTTP 401" in line, line
    assert domain("pull", tmp_path / "none.json").code == 0  # the credentials it was pulled with
    proved = domain(None, node_auth, "--no-lazy")  # the node's own, once they read its manifest
    assert proved.code == 0, proved.err
