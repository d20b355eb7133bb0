"""Generated disks end to end with the real guest as the qemu user: cloud-init NoCloud and ConfigDrive,
a ConfigMap, a Secret and a ServiceAccount token from --manifests, a downwardAPI volume and the
downwardMetrics disk; the guest mounts every ISO and prints its label and files. Bad input fails
before anything is defined and leaves nothing behind."""

from __future__ import annotations

import base64
import json
import stat
import struct
import subprocess
import time

from launcher.node.cache import entry_name
from launcher.spec.meta import domain_name
from tests.testguest import parse_console
from tests.vmhost import DONE, NOREG, QEMU_UID, assert_clean

USER_DATA = "#cloud-config\nhostname: from-cloud-init\n"
NETWORK_DATA = "version: 2\nethernets: {}\n"
CONFIG_DRIVE_DATA = "#!/bin/sh\necho config drive\n"
UUID = "11111111-2222-4333-8444-555555555555"


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _virtio(name: str, serial: str | None = None) -> dict:
    return {"name": name, "disk": {"bus": "virtio"}, **({"serial": serial} if serial else {})}


def write_manifests(root, namespace: str = "default"):
    manifests = root / "manifests"
    manifests.mkdir(exist_ok=True)
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app-config", "namespace": namespace},
         "data": {"app.properties": "color=blue\nsize=3\n"}, "binaryData": {"blob.bin": b64(b"BIN\x01")}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "app-secret", "namespace": namespace},
         "data": {"password": b64("s3cret\n")}, "stringData": {"username": "admin\n"}},
        {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
         "metadata": {"name": "builder-token", "namespace": namespace,
                      "annotations": {"kubernetes.io/service-account.name": "builder"}},
         "data": {"token": b64("eyJhbGciOiJSUzI1NiJ9.payload.sig"), "ca.crt": b64("-----BEGIN CERTIFICATE-----\n"),
                  "namespace": b64(namespace)}},
    ]
    (manifests / "objects.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return manifests


def test_every_generated_disk_reaches_the_guest(qemu_user, guest_image):
    manifests = write_manifests(qemu_user.root)
    extra = [
        (_virtio("ci", "ci"), {"name": "ci", "cloudInitNoCloud": {"userData": USER_DATA, "networkDataBase64": b64(NETWORK_DATA)}}),
        (_virtio("cd", "cd"), {"name": "cd", "cloudInitConfigDrive": {"userDataBase64": b64(CONFIG_DRIVE_DATA)}}),
        (_virtio("cm", "cm"), {"name": "cm", "configMap": {"name": "app-config", "volumeLabel": "APPCFG"}}),
        (_virtio("sec", "sec"), {"name": "sec", "secret": {"secretName": "app-secret"}}),
        (_virtio("sa", "sa"), {"name": "sa", "serviceAccount": {"serviceAccountName": "builder"}}),
        (_virtio("dapi", "dapi"), {"name": "dapi", "downwardAPI": {"volumeLabel": "podinfo", "fields": [
            {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}),
        (_virtio("metrics", "metrics"), {"name": "metrics", "downwardMetrics": {}}),
    ]
    # The guest stays up after its report, so the metrics refresher can be watched at work; once it
    # was, and the guest has reported, its power button ends the run.
    vmi_path = qemu_user.write_vmi("gen", guest_image, serial="hold-240", extra=extra)
    vmi = json.loads(vmi_path.read_text())
    vmi["metadata"]["labels"] = {"app": "shop"}
    vmi["spec"]["domain"]["firmware"] = {"uuid": UUID}
    vmi_path.write_text(json.dumps(vmi))

    proc = qemu_user.popen("run", NOREG, "--console", "--timeout", "240", "--manifests", manifests, "--feature-gates", "DownwardMetrics", vmi_path)
    metrics_disk = qemu_user.cache / "run" / "default_gen" / "downwardapi-disks" / "vhostmd0"
    body = b""
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and b"ResourceProcessorLimit" not in body:
        if metrics_disk.exists():
            raw = metrics_disk.read_bytes()
            signature, flag, checksum, length = struct.unpack(">4siii", raw[:16])
            if flag == 0 and 0 < length < len(raw):
                candidate = raw[16:16 + length]
                if sum(candidate) == checksum:
                    body = candidate
        time.sleep(0.5)
    _power_off_once_reported(qemu_user, "default_gen", proc)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    # Refreshed from libvirt while the VM ran: the VM's own figures, beside the host's.
    assert b"<name>ResourceProcessorLimit</name>\n    <value><![CDATA[1]]></value>" in body, body
    assert b"<name>ResourceMemoryLimit</name>\n    <value><![CDATA[131072]]></value>" in body, body  # 128Mi in KiB
    assert b"<name>VirtualizationVendor</name>\n    <value><![CDATA[kubevirt.io]]></value>" in body

    console = parse_console(out)
    assert console["ready"] and console["done"], out
    by_serial = {disk["serial"]: name for name, disk in console["disks"].items()}
    isos = {serial: console["isos"].get(name) for serial, name in by_serial.items()}

    nocloud = isos["ci"]
    assert nocloud["label"] == "cidata"
    assert nocloud["files"]["/user-data"] == USER_DATA
    assert nocloud["files"]["/network-config"] == NETWORK_DATA
    meta = json.loads(nocloud["files"]["/meta-data"])
    assert meta == {"instance-id": UUID, "local-hostname": "gen"}

    drive = isos["cd"]
    assert drive["label"] == "config-2"
    assert drive["files"]["/openstack/latest/user_data"] == CONFIG_DRIVE_DATA
    assert json.loads(drive["files"]["/openstack/latest/meta_data.json"]) == {
        "instance_id": "gen.default", "hostname": "gen", "uuid": UUID}
    assert "/openstack/latest/network_data.json" not in drive["files"]

    config = isos["cm"]
    assert config["label"] == "APPCFG"
    assert config["files"]["/app.properties"] == "color=blue\nsize=3\n"
    assert config["sizes"]["/blob.bin"] == 4

    secret = isos["sec"]
    assert secret["label"] == "cfgdata"  # no volumeLabel
    assert secret["files"] == {"/password": "s3cret\n", "/username": "admin\n"}

    account = isos["sa"]
    assert account["files"]["/token"] == "eyJhbGciOiJSUzI1NiJ9.payload.sig\n"  # the guest ends every line it prints
    assert account["files"]["/namespace"] == "default\n"
    assert set(account["files"]) == {"/token", "/namespace", "/ca.crt"}
    assert account["label"] == "cfgdata"

    podinfo = isos["dapi"]
    assert podinfo["label"] == "podinfo"
    assert podinfo["files"] == {"/name": "gen\n", "/labels": 'app="shop"\n'}

    metrics = console["disks"][by_serial["metrics"]]
    assert metrics["ro"] and metrics["size"] == 262144
    assert metrics["head"].startswith(b"mvbd".hex())  # vhostmd's signature
    assert isos["metrics"] is None
    assert_clean(qemu_user, "default_gen")


def test_malformed_user_data_fails_before_anything_is_made(qemu_user, guest_image):
    extra = [(_virtio("ci"), {"name": "ci", "cloudInitNoCloud": {"userDataBase64": "not*base64"}})]
    vmi = qemu_user.write_vmi("badci", guest_image, extra=extra)
    result = qemu_user.launcher("run", NOREG, vmi)
    assert result.code == 1
    assert result.err.strip().splitlines()[-1].endswith(
        "spec.volumes[1].cloudInitNoCloud.userDataBase64: is not a valid base64 value."), result.err
    assert_clean(qemu_user, "default_badci")


def test_missing_config_objects_fail_clearly_and_leave_nothing(qemu_user, guest_image):
    manifests = write_manifests(qemu_user.root)
    for name, volume, message in [
        ("nocm", {"configMap": {"name": "absent-config"}}, 'configmaps "absent-config" not found in namespace default'),
        ("nosecret", {"secret": {"secretName": "absent-secret"}}, 'secrets "absent-secret" not found in namespace default'),
        ("nosa", {"serviceAccount": {"serviceAccountName": "nobody"}}, "serviceAccount nobody: no token Secret for it"),
    ]:
        # The ConfigMap that exists comes first: its ISO is written before the missing one fails.
        extra = [(_virtio("cm"), {"name": "cm", "configMap": {"name": "app-config"}}), (_virtio("x"), {"name": "x", **volume})]
        vmi = qemu_user.write_vmi(name, guest_image, extra=extra)
        result = qemu_user.launcher("run", NOREG, "--manifests", manifests, vmi)
        assert result.code == 1, result.err
        lines = result.err.strip().splitlines()
        assert message in lines[-1] and lines[-1].startswith("launcher: spec.volumes[2]."), result.err
        assert_clean(qemu_user, f"default_{name}")
    # optional: an empty ISO instead, and the VM starts
    extra = [(_virtio("opt", "opt"), {"name": "opt", "configMap": {"name": "absent-config", "optional": True}})]
    vmi = qemu_user.write_vmi("optional", guest_image, extra=extra)
    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", "--manifests", manifests, vmi)
    assert result.code == 0, result.err
    console = parse_console(result.out)
    name = next(n for n, d in console["disks"].items() if d["serial"] == "opt")
    assert console["isos"][name] == {"label": "cfgdata", "files": {}, "sizes": {}}, console


# The longest names Kubernetes allows: a 253-character VMI in a 63-character namespace.
LONG_NAME = ".".join(["a" * 63] * 4)[:252] + "z"
LONG_NAMESPACE = "n" * 63
SECRET_USER_DATA = "#cloud-config\npassword: hunter2-very-secret\nchpasswd: {expire: false}\n"


def _unreadable_by_nobody(path) -> bool:
    """Whether the unprivileged `nobody` fails to read `path` (or to enter its directories)."""
    proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "cat", str(path)],
                          capture_output=True, check=False)
    return proc.returncode != 0 and b"Permission denied" in proc.stderr and proc.stdout == b""


def _power_off_once_reported(qemu_user, domain: str, proc: subprocess.Popen) -> None:
    """Press the power button of a holding guest once its console says it has reported."""
    log = qemu_user.cache / "run" / entry_name(domain) / "console" / "console.log"
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and DONE not in (log.read_text(errors="replace") if log.is_file() else ""):
        time.sleep(0.2)
    if proc.poll() is None:
        stopped = qemu_user.launcher("stop", domain)
        assert stopped.code == 0, stopped.err


def test_long_names_run_and_secrets_are_private_while_the_vm_runs(qemu_user, guest_image):
    (qemu_user.root / "long").mkdir()
    manifests = write_manifests(qemu_user.root / "long", LONG_NAMESPACE)
    vmi_path = qemu_user.write_vmi("long", guest_image, serial="hold-240", extra=[
        (_virtio("ci", "ci"), {"name": "ci", "cloudInitNoCloud": {"userData": SECRET_USER_DATA}}),
        (_virtio("sec", "sec"), {"name": "sec", "secret": {"secretName": "app-secret"}}),
        (_virtio("sa", "sa"), {"name": "sa", "serviceAccount": {"serviceAccountName": "builder"}})])
    vmi = json.loads(vmi_path.read_text())
    vmi["metadata"] = {"name": LONG_NAME, "namespace": LONG_NAMESPACE}
    vmi_path.write_text(json.dumps(vmi))
    domain = domain_name(LONG_NAMESPACE, LONG_NAME)  # 317 bytes as KubeVirt's: shortened for libvirt
    assert len(domain) == 247
    run_dir = qemu_user.cache / "run" / entry_name(domain)
    iso_path = run_dir / "cloud-init-data" / LONG_NAMESPACE / LONG_NAME / "noCloud.iso"

    secret_isos = [run_dir / "secret-disks" / "sec.iso", run_dir / "service-account-disk" / "service-account.iso"]

    proc = qemu_user.popen("run", NOREG, "--console", "--timeout", "240", "--manifests", manifests, vmi_path)
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and domain not in qemu_user.virsh("list", "--name").split():
            time.sleep(0.5)
        assert domain in qemu_user.virsh("list", "--name").split(), proc.stderr.read() if proc.poll() is not None else "not started"
        # Running: the secret-carrying image and every directory down to it are the qemu user's alone.
        assert iso_path.is_file()
        for directory in (run_dir, *iso_path.parents[:3]):
            st = directory.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, QEMU_UID), directory
        for iso in (iso_path, *secret_isos):
            st = iso.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, QEMU_UID), iso
            assert stat.S_IMODE(iso.parent.stat().st_mode) == 0o700, iso.parent
            assert _unreadable_by_nobody(iso)
        assert _unreadable_by_nobody(run_dir / "console" / "console.log")
        _power_off_once_reported(qemu_user, domain, proc)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    console = parse_console(out)
    assert console["ready"] and console["done"], out
    by_serial = {disk["serial"]: name for name, disk in console["disks"].items()}
    nocloud = console["isos"][by_serial["ci"]]
    assert nocloud["label"] == "cidata" and nocloud["files"]["/user-data"] == SECRET_USER_DATA  # the guest still reads them
    assert console["isos"][by_serial["sec"]]["files"] == {"/password": "s3cret\n", "/username": "admin\n"}
    assert console["isos"][by_serial["sa"]]["files"]["/token"] == "eyJhbGciOiJSUzI1NiJ9.payload.sig\n"
    assert not run_dir.exists() and not (qemu_user.cache / "vms" / f"{entry_name(domain)}.json").exists()
    assert domain not in qemu_user.virsh("list", "--all", "--name").split()


def test_downward_metrics_need_kubevirts_gate_and_the_port_is_refused(tmp_path):
    # vmi-create-admitter.go validateVolumes and validateDownwardMetrics: both behind the DownwardMetrics
    # gate (off by default), in KubeVirt's words; with it the disk is rendered, and the virtio-serial
    # port, which only virt-handler's server (pkg/downwardmetrics/virtio-serial/server.go) answers, is
    # refused in one line naming it.
    import xml.etree.ElementTree as ET

    from tests.conftest import run_launcher

    def domain(name: str, devices: dict, volumes: list, *flags: str):
        doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
               "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": devices}, "volumes": volumes}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        return run_launcher("domain", "--accel", "qemu", "--cache-dir", tmp_path / "cache", *flags, path)

    disk = ({"disks": [_virtio("metrics")]}, [{"name": "metrics", "downwardMetrics": {}}])
    refused = domain("disk", *disk)
    assert refused.code == 1
    assert refused.err.strip() == "launcher: spec.volumes[0]: downwardMetrics disks are not allowed: DownwardMetrics feature gate is not enabled."
    allowed = domain("disk", *disk, "--feature-gates", "DownwardMetrics")
    assert allowed.code == 0, allowed.err
    assert [d.find("source").get("file").endswith("downwardapi-disks/vhostmd0") for d in ET.fromstring(allowed.out).iter("disk")] == [True]

    port = ({"downwardMetrics": {}}, [])
    refused = domain("port", *port)
    assert refused.code == 1
    assert refused.err.strip() == ("launcher: spec.domain.devices.downwardMetrics: downwardMetrics virtio serial is not allowed:"
                                   " DownwardMetrics feature gate is not enabled")
    refused = domain("port", *port, "--feature-gates", "DownwardMetrics")
    assert refused.code == 1 and len(refused.err.strip().splitlines()) == 1, refused.err
    assert refused.err.startswith("launcher: spec.domain.devices.downwardMetrics: its virtio-serial port needs virt-handler's metrics server"), refused.err
