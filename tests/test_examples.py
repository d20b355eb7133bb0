"""Every file under examples/ is used as shipped by a test: USED_BY names the test for each, and the
tests here run the ones no other test runs.

What a test may change in an example: the registry address or image reference only (the examples
name registry.example.com and quay.io; the tests have a registry on loopback), and it says so where
it does. Everything else runs as written: a test that needs more has found a broken example, and the
example is what gets fixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import launcher_command, make_qcow2, run_diskkit, run_launcher
from tests.distribution import free_port
from tests.fileserver import FileServer
from tests.test_launcher_datavolumes import Running
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
MIB = 1 << 20

# example -> the test that uses it as shipped ("file::function")
USED_BY = {
    "examples/ci/pipeline.sh": "tests/test_ci_pipeline.py::test_pipeline_publishes_skips_refuses_and_prunes",
    "examples/vmi-containerdisk.yaml": "tests/test_examples.py::test_the_ci_script_pushes_an_image_the_example_vmi_boots",
    "examples/ci/build-and-push.sh": "tests/test_examples.py::test_the_ci_script_pushes_an_image_the_example_vmi_boots",
    "examples/datavolumes/datavolumes.yaml": "tests/test_examples.py::test_the_datavolume_examples_import_and_wait_as_written",
    "examples/datavolumes/vm.yaml": "tests/test_examples.py::test_the_datavolume_example_vm_imports_its_root_waits_for_the_upload_and_boots",
    "examples/instancetypes/vm.yaml": "tests/test_examples.py::test_the_instancetype_example_boots_sized_by_its_instancetype",
    "examples/instancetypes/types.yaml": "tests/test_examples.py::test_the_instancetype_example_boots_sized_by_its_instancetype",
    "examples/kubernetes/pod.yaml": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
    # podman 4.3 cannot play image volumes: the pod is checked against KubeVirt's layout, and the
    # launcher's side of it boots from an unpacked image in tests/test_imagevolume.py.
    "examples/kubernetes/pod-imagevolume.yaml": "tests/test_kubernetes.py::test_the_image_volume_pod_mounts_each_containerdisk_where_kubevirt_does",
    "examples/kubernetes/configmap.yaml": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
    "examples/kubernetes/pvc.yaml": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
    "examples/kubernetes/secret.yaml": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
    # The commands examples/kubernetes/README.md gives for podman, run as written.
    "examples/kubernetes/podman-play.sh": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
    "examples/kubernetes/podman-down.sh": "tests/test_pod.py::test_the_readme_plays_the_example_pod_which_stays_up_until_podman_down",
}


def test_every_example_is_used_by_a_test_that_exists():
    # READMEs say how to use the rest; their commands need a cluster.
    shipped = sorted(str(p.relative_to(REPO)) for p in EXAMPLES.rglob("*") if p.is_file() and p.name != "README.md")
    assert shipped == sorted(USED_BY), "an example without a test (or a test of a removed example)"
    for example, test in USED_BY.items():
        path, _, function = test.partition("::")
        source = (REPO / path).read_text()
        assert f"def {function}(" in source, f"{example}: {test} does not exist"
        # The test reaches the file: by its name, or its directory's (loaded whole).
        assert Path(example).name in source or f'"{Path(example).parent.name}"' in source, f"{test} does not use {example}"


@contextlib.contextmanager
def roomy(path: Path):
    """A tmpfs for claims as large as the examples ask (10Gi, 20Gi): KubeVirt's sizing wants the free
    space a sparse disk.img may grow to, whatever the runner's disk has; only what is written uses memory."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=32g,mode=0755,uid={QEMU_UID},gid={QEMU_UID}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=True)


def _insecure_registries_conf(path: Path, host: str) -> Path:
    # The loopback registry speaks plain HTTP; the script's commands are left as written and told so
    # the way skopeo and podman are, through registries.conf.
    path.write_text(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n')
    path.chmod(0o644)
    return path


def test_the_ci_script_pushes_an_image_the_example_vmi_boots(qemu_user, auth_registry):
    """examples/ci/build-and-push.sh as a CI job runs it (credentials from REGISTRY_AUTH_FILE, the
    CI's revision in an annotation), then examples/vmi-containerdisk.yaml boots what it pushed, with
    the image reference substituted (registry.example.com -> the test's registry on loopback)."""
    work = qemu_user.root / "ci"
    work.mkdir()
    raw = work / "guest.img"  # a raw disk in, as the script's comment says it takes
    subprocess.run(["qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", raw], check=True)
    auth = auth_registry.auth_file(qemu_user.root / "auth.json")
    auth.chmod(0o644)  # the qemu user pulls with it too
    conf = _insecure_registries_conf(qemu_user.root / "registries.conf", auth_registry.host)
    image = f"{auth_registry.host}/examples/testguest:v1"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "CI": "true",
           "REGISTRY_AUTH_FILE": str(auth), "CONTAINERS_REGISTRIES_CONF": str(conf),
           "GITHUB_SERVER_URL": "https://github.example", "GITHUB_REPOSITORY": "me/disks", "GITHUB_SHA": "0123abc"}
    script = subprocess.run(["bash", EXAMPLES / "ci" / "build-and-push.sh", raw, image], cwd=work, env=env,
                            capture_output=True, text=True, timeout=600)
    assert script.returncode == 0, script.stderr
    built = json.loads((work / "build.json").read_text())
    assert built["digest"].startswith("sha256:"), built
    assert subprocess.run(["qemu-img", "info", "--output=json", work / "disk.qcow2"], capture_output=True,
                          check=True, text=True).stdout.count('"format": "qcow2"') == 1
    inspected = run_diskkit("inspect", "--raw", image, env={k: env[k] for k in ("REGISTRY_AUTH_FILE", "CONTAINERS_REGISTRIES_CONF")})
    assert inspected.code == 0, inspected.err
    annotations = json.loads(inspected.out).get("annotations", {})
    assert annotations["org.opencontainers.image.revision"] == "0123abc", annotations
    assert annotations["org.opencontainers.image.source"] == "https://github.example/me/disks", annotations

    # The example VMI, its image reference the only change.
    vmi = yaml.safe_load((EXAMPLES / "vmi-containerdisk.yaml").read_text())
    (root,) = vmi["spec"]["volumes"]
    assert root["containerDisk"]["image"] == "registry.example.com/disks/testguest:v1"
    root["containerDisk"]["image"] = image
    vmi_file = qemu_user.root / "vmi-containerdisk.yaml"
    vmi_file.write_text(yaml.safe_dump(vmi))
    run = run_launcher("run", "--console", "--timeout", "400", vmi_file, user=str(QEMU_UID), timeout=600,
                       env={**qemu_user.env, "REGISTRY_AUTH_FILE": str(auth), "CONTAINERS_REGISTRIES_CONF": str(conf)})
    assert run.code == 0, run.err
    console = parse_console(run.out)
    assert console["ready"] and console["done"], run.out
    assert console["disks"]["vda"]["size"] == 64 * MIB and console["disks"]["vda"]["head"].startswith("33c0"), console["disks"]
    # No interfaces written: KubeVirt attaches the default pod interface.
    assert "NET-NIC iface=eth0" in run.out, run.out
    assert_clean(qemu_user, "default_testguest")


def test_the_datavolume_examples_import_and_wait_as_written(tmp_path, registry):
    """examples/datavolumes as `--manifests`: `golden` imports its containerDisk (the registry URL
    substituted: quay.io -> the test's registry on loopback) into a claim of the size it asks, and
    `fedora-data`, on a WaitForFirstConsumer storage class, waits for its VM."""
    image = f"{registry.host}/containerdisks/fedora:40"
    built = run_diskkit("build", NOREG, "--no-lazy", ensure_testguest() / "testguest-poweroff.qcow2", "-t", image)
    assert built.code == 0, built.err
    manifests = tmp_path / "datavolumes"
    manifests.mkdir()
    docs = list(yaml.safe_load_all((EXAMPLES / "datavolumes" / "datavolumes.yaml").read_text()))
    (golden,) = [d for d in docs if d and d["metadata"]["name"] == "golden"]
    assert golden["spec"]["source"]["registry"]["url"] == "docker://quay.io/containerdisks/fedora:40"
    golden["spec"]["source"]["registry"]["url"] = f"docker://{image}"
    (manifests / "datavolumes.yaml").write_text(yaml.safe_dump_all(docs))
    shutil.copy(EXAMPLES / "datavolumes" / "vm.yaml", manifests / "vm.yaml")
    with roomy(tmp_path / "claims") as room:
        claims = {name: room / name for name in ("golden", "fedora-data", "fedora-root")}
        for path in claims.values():
            path.mkdir()
        check_golden_and_fedora_data(manifests, claims)


def check_golden_and_fedora_data(manifests: Path, claims: dict[str, Path]) -> None:
    args = ["--manifests", manifests, *(a for name, path in claims.items() for a in ("--pvc", f"{name}={path}"))]
    imported = run_launcher("dv", "import", NOREG, "golden", *args)
    assert imported.code == 0, imported.err
    disk = claims["golden"] / "disk.img"
    assert disk.stat().st_size == 10 << 30  # the DataVolume's storage request
    same = subprocess.run(["qemu-img", "compare", "-q", "-f", "raw", "-F", "qcow2", disk, ensure_testguest() / "testguest-poweroff.qcow2"])
    assert same.returncode == 0
    status = run_launcher("dv", "status", "golden", "--json", *args)
    assert status.code == 0 and json.loads(status.out)["phase"] == "Succeeded", status.out + status.err

    waiting = run_launcher("dv", "status", "fedora-data", "--json", *args)
    assert waiting.code == 0, waiting.err
    assert json.loads(waiting.out)["phase"] == "WaitForFirstConsumer", waiting.out


def test_the_datavolume_example_vm_imports_its_root_waits_for_the_upload_and_boots(qemu_user, tmp_path):
    """examples/datavolumes/vm.yaml run as its comment says, with examples/datavolumes as --manifests
    (copied as shipped; `golden` is not the VM's and is left alone): the run imports the root disk
    over HTTP (the download URL substituted: the test guest from a file server on loopback), waits
    for fedora-data, which its first consumer has bound, until `diskkit upload` fills it through
    `launcher serve --upload-listen`, then boots from both."""
    www = tmp_path / "www"
    www.mkdir()
    shutil.copy(ensure_testguest() / "testguest-poweroff.qcow2", www / "Fedora-Cloud-Base-Generic.x86_64-40-1.14.qcow2")
    data = make_qcow2(tmp_path / "data.qcow2", "48M", pattern=0xAB)
    manifests = qemu_user.root / "datavolumes"
    manifests.mkdir()
    shutil.copy(EXAMPLES / "datavolumes" / "datavolumes.yaml", manifests / "datavolumes.yaml")
    with roomy(qemu_user.root / "claims") as room:
        claims = {}
        for name in ("fedora-root", "fedora-data"):
            claims[name] = room / name
            claims[name].mkdir()
            os.chown(claims[name], QEMU_UID, QEMU_UID)
        check_the_fedora_vm(qemu_user, tmp_path, www, data, manifests, claims)


def check_the_fedora_vm(qemu_user, tmp_path: Path, www: Path, data: Path, manifests: Path, claims: dict[str, Path]) -> None:
    storage = ["--manifests", manifests, *(a for name, path in claims.items() for a in ("--pvc", f"{name}={path}"))]
    host = f"127.0.0.1:{free_port()}"
    cache = tmp_path / "serve-cache"
    with FileServer(www) as server:
        vm = yaml.safe_load((EXAMPLES / "datavolumes" / "vm.yaml").read_text())
        (template,) = vm["spec"]["dataVolumeTemplates"]
        url = template["spec"]["source"]["http"]["url"]
        template["spec"]["source"]["http"]["url"] = server.url(url.rsplit("/", 1)[1])
        vm_file = qemu_user.root / "fedora-vm.yaml"
        vm_file.write_text(yaml.safe_dump(vm))
        serve = subprocess.Popen(launcher_command("serve", "--no-disks", "--upload-listen", host, "--cache-dir", cache, *map(str, storage)),
                                 stderr=subprocess.DEVNULL)
        try:
            run = Running(qemu_user, "run", "--console", "--timeout", "400", *storage, vm_file)
            run.wait_for_upload("fedora-data", 300)
            token = run_launcher("dv", "token", "fedora-data", "--cache-dir", cache)
            assert token.code == 0, token.err
            sent = run_diskkit("upload", "fedora-data", data, "--url", f"http://{host}", "--token", token.out.strip(), "--wait", "60")
            assert sent.code == 0, sent.err
            code, out, err = run.finish(400)
        finally:
            serve.terminate()
            serve.wait(30)
    assert code == 0, err
    assert "DataVolume default/fedora-root: http import from" in err, err
    console = parse_console(out)
    assert console["ready"] and console["done"], out
    disks = console["disks"]
    # The sizes the example asks for; the guest booted from the imported root, and sees the upload.
    assert disks["vda"]["size"] == 10 << 30 and disks["vda"]["head"].startswith("33c0"), disks
    assert disks["vdb"]["size"] == 20 << 30 and disks["vdb"]["head"] == "ab" * 16, disks
    for name in claims:
        assert json.loads((claims[name] / "datavolume.json").read_text())["phase"] == "Succeeded"
    assert_clean(qemu_user, "default_fedora")


def test_the_instancetype_example_boots_sized_by_its_instancetype(qemu_user, guest_image):
    """examples/instancetypes/vm.yaml run as its comment says, with examples/instancetypes as
    --manifests (types.yaml as shipped), the image reference substituted (quay.io -> the test's
    registry on loopback): the guest has the instance type's 2 vCPUs and 4 GiB and its cloud-init."""
    vm = yaml.safe_load((EXAMPLES / "instancetypes" / "vm.yaml").read_text())
    (root,) = [v for v in vm["spec"]["template"]["spec"]["volumes"] if v["name"] == "root"]
    assert root["containerDisk"]["image"] == "quay.io/containerdisks/fedora:40"
    root["containerDisk"]["image"] = guest_image
    vm_file = qemu_user.root / "sized.yaml"
    vm_file.write_text(yaml.safe_dump(vm))
    run = qemu_user.launcher("run", NOREG, "--console", "--timeout", "400", "--manifests", EXAMPLES / "instancetypes", vm_file, timeout=600)
    assert run.code == 0, run.err
    console = parse_console(run.out)
    assert console["ready"] and console["done"], run.out
    assert console["cpus"] == 2, run.out
    assert 3 << 20 < console["mem_kib"] <= 4 << 20, console["mem_kib"]  # MemTotal: 4 GiB less the kernel's own
    assert console["disks"]["vda"]["head"].startswith("33c0"), console["disks"]  # vdX: the preference's virtio bus
    assert any("password: fedora" in "".join(iso["files"].values()) for iso in console["isos"].values()), console["isos"]
    assert_clean(qemu_user, "default_sized")
