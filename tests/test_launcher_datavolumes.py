"""DataVolumes end to end with the real guest, as the qemu user: `launcher run` imports its VM's
dataVolumeTemplates (HTTP qcow2 from a real HTTP server, a registry image built with diskkit),
waits for a standalone DataVolume until it is imported, then boots from the imported disk; an
upload DataVolume under WaitForFirstConsumer is bound by the VM, uploaded, and booted."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import launcher_command, make_qcow2, run_diskkit, run_launcher
from tests.distribution import free_port
from tests.fileserver import FileServer
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean

MIB = 1 << 20
WFFC_CLASS = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local-wffc"},
              "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}


def _dv(name: str, source: dict, size: str, **storage) -> dict:
    return {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
            "spec": {"source": source, "storage": {"resources": {"requests": {"storage": size}}, **storage}}}


def _claim(user, name: str) -> Path:
    path = user.root / f"claim-{name}"
    path.mkdir()
    os.chown(path, QEMU_UID, QEMU_UID)
    return path


def _vmi(user, name: str, disks: list[tuple[str, str]], templates: list[dict] = ()) -> Path:
    """A VMI whose disks are all dataVolume volumes on virtio; the first boots."""
    spec = {
        "domain": {"resources": {"requests": {"memory": "128Mi"}},
                   "devices": {"disks": [{"name": vol, "serial": serial, "disk": {"bus": "virtio"}, **({"bootOrder": 1} if i == 0 else {})}
                                         for i, (vol, serial) in enumerate(disks)]}},
        "volumes": [{"name": vol, "dataVolume": {"name": vol}} for vol, _ in disks],
    }
    if templates:
        spec["dataVolumeTemplates"] = [{"metadata": t["metadata"], "spec": t["spec"]} for t in templates]
    path = user.root / f"{name}.yaml"
    path.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name}, "spec": spec}))
    return path


class Running:
    """`launcher run` as the qemu user in the background: stderr lines as they come, stdout collected."""

    def __init__(self, user, *args):
        self.proc = user.popen(*args)
        self.err: list[str] = []
        self.out: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True)]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _pump(stream, sink):
        for line in stream:
            sink.append(line)

    def wait_for(self, text: str, timeout: float = 240) -> str:
        """The first stderr line holding `text`, once there is one."""
        deadline = time.monotonic() + timeout
        while not (seen := [line for line in self.err if text in line]):
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, f"no {text!r} on stderr:\n{''.join(self.err)}"
            time.sleep(0.2)
        return seen[0].rstrip("\n")

    def wait_for_upload(self, name: str, timeout: float = 240) -> None:
        """The run waits for an upload DataVolume: UploadScheduled, or UploadReady when the upload
        server marked the bound claim before the run first looked (both are CDI's waiting phases)."""
        line = self.wait_for(f"waiting for DataVolume default/{name} (Upload", timeout)
        assert line.split("launcher: ", 1)[-1] in {f"waiting for DataVolume default/{name} ({phase}; upload it with: diskkit upload default/{name} FILE)"
                                                   for phase in ("UploadScheduled", "UploadReady")}, line

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        code = self.proc.wait(timeout)
        for thread in self._threads:
            thread.join(10)
        return code, "".join(self.out), "".join(self.err)


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    (root / "guest.qcow2").write_bytes((ensure_testguest() / "testguest-poweroff.qcow2").read_bytes())
    with open(root / "data.img", "wb") as f:
        f.write(b"\xcd" * MIB)
        f.truncate(24 * MIB)
    with FileServer(root) as server:
        yield server


def test_run_imports_its_templates_and_the_standalone_datavolumes_it_uses_then_boots(qemu_user, www, registry, tmp_path):
    image = f"{registry.host}/dv/data:v1"
    built = run_diskkit("build", NOREG, make_qcow2(tmp_path / "data.qcow2", "48M", pattern=0xAB), "-t", image)
    assert built.code == 0, built.err
    root = _dv("root", {"http": {"url": www.url("guest.qcow2")}}, "80Mi")
    regdata = _dv("regdata", {"registry": {"url": f"docker://{image}"}}, "56Mi")
    manifests = qemu_user.root / "dv-manifests"
    manifests.mkdir()
    (manifests / "rawdata.yaml").write_text(yaml.safe_dump(_dv("rawdata", {"http": {"url": www.url("data.img")}}, "40Mi")))
    claims = {name: _claim(qemu_user, name) for name in ("root", "regdata", "rawdata")}
    storage = ["--manifests", manifests, *(arg for name, path in claims.items() for arg in ("--pvc", f"{name}={path}"))]
    vmi = _vmi(qemu_user, "dvvm", [("root", "dv-root"), ("rawdata", "dv-raw"), ("regdata", "dv-reg")], [root, regdata])

    # As CDI's controller would, the run imports the standalone DataVolume too, with progress, then boots.
    run = Running(qemu_user, "run", NOREG, "--console", "--timeout", "300", *storage, vmi)
    code, out, err = run.finish()
    for name in ("root", "regdata", "rawdata"):
        assert json.loads((claims[name] / "datavolume.json").read_text())["phase"] == "Succeeded"
    assert "DataVolume default/rawdata: http import from" in err
    assert "DataVolume default/root: ImportInProgress 50% (TransferScratch)" in err  # the download's progress, told as it goes
    assert code == 0, err
    console = parse_console(out)
    assert console["ready"] and console["done"], out
    disks = {disk["serial"]: disk for disk in console["disks"].values()}
    assert disks["dv-root"]["size"] == 80 * MIB and disks["dv-root"]["head"].startswith("33c0")  # booted from the import
    assert disks["dv-raw"]["size"] == 40 * MIB and disks["dv-raw"]["head"] == "cd" * 16
    assert disks["dv-reg"]["size"] == 56 * MIB and disks["dv-reg"]["head"] == "ab" * 16
    assert sorted(console["stamps"].values()) == [(0, 1)] * 3  # every claim writable by the guest
    assert "DataVolume default/root: http import from" in err and "DataVolume default/regdata: registry import from" in err
    assert_clean(qemu_user, "default_dvvm")
    listed = qemu_user.launcher("dv", "ls", "--json", "--vmi", vmi, *storage)
    assert {row["name"]: row["phase"] for row in json.loads(listed.out)} == {"root": "Succeeded", "regdata": "Succeeded", "rawdata": "Succeeded"}


def test_an_upload_waits_for_its_first_consumer_then_the_vm_boots_from_it(qemu_user, tmp_path):
    manifests = qemu_user.root / "upload-manifests"
    manifests.mkdir()
    (manifests / "dv.yaml").write_text(yaml.safe_dump_all([WFFC_CLASS, _dv("upboot", {"upload": {}}, "80Mi", storageClassName="local-wffc"),
                                                           _dv("never", {"upload": {}}, "16Mi")]))
    claims = {name: _claim(qemu_user, name) for name in ("upboot", "never")}
    storage = ["--manifests", manifests, *(arg for name, path in claims.items() for arg in ("--pvc", f"{name}={path}"))]
    host = f"127.0.0.1:{free_port()}"
    cache = tmp_path / "serve-cache"
    serve = subprocess.Popen(launcher_command("serve", "--no-disks", "--upload-listen", host, "--cache-dir", cache, *map(str, storage)),
                             stderr=subprocess.DEVNULL)
    try:
        token = run_launcher("dv", "token", "upboot", "--cache-dir", cache).out.strip()
        disk = ensure_testguest() / "testguest-poweroff.qcow2"
        send = ["upload", "upboot", disk, "--url", f"http://{host}", "--token", token, "--wait", "30"]
        for _ in range(100):  # until the server listens
            early = run_diskkit(*send)
            if "cannot reach" not in early.err:
                break
            time.sleep(0.2)
        assert early.code == 1 and "cannot upload to DataVolume in state WaitForFirstConsumer" in early.err, early.err

        vmi = _vmi(qemu_user, "upvm", [("upboot", "dv-up")])
        run = Running(qemu_user, "run", "--console", "--timeout", "300", *storage, vmi)
        run.wait_for_upload("upboot")
        assert "default_upvm is the first consumer of claim upboot" in "".join(run.err)
        sent = run_diskkit(*send)
        assert sent.code == 0, sent.err
        code, out, err = run.finish()
        assert code == 0, err
        console = parse_console(out)
        assert console["done"] and console["disks"]["vda"]["size"] == 80 * MIB and console["disks"]["vda"]["head"].startswith("33c0"), out
        assert_clean(qemu_user, "default_upvm")

        # Nobody uploads to this one: the run gives up at its timeout, and no domain was ever made.
        lonely = _vmi(qemu_user, "lonely", [("never", "n")])
        result = qemu_user.launcher("run", "--timeout", "3", *storage, lonely)
        assert result.code == 1
        assert result.err.strip().splitlines()[-1] == "launcher: DataVolume default/never: still UploadReady after 3 s; the VM was not started", result.err
        assert_clean(qemu_user, "default_lonely")
    finally:
        serve.terminate()
        serve.wait(30)
