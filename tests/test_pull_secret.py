"""containerDisk.imagePullSecret (issue 30 item 6): the Secret in --manifests gives that image's pulls
their credentials, as the kubelet uses the pull secrets KubeVirt puts on the pod
(kubevirt pkg/virt-controller/services/rendervolumes.go); against the real registry with basic auth."""

from __future__ import annotations

import base64
import json
import uuid

import yaml

from tests.conftest import run_launcher
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
