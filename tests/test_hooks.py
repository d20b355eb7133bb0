"""Hook sidecars: KubeVirt's `hooks.kubevirt.io/hookSidecars` ConfigMap scripts, admitted as KubeVirt
admits them (pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go, pkg/hooks/hooks.go,
cmd/sidecars/sidecar_shim.go), run as the sidecar-shim runs them (`onDefineDomain --vmi JSON --domain
XML`, its standard output the new domain) but as the VM's own uid, in namespaces of their own, within
KubeVirt's minute and gRPC's 4 MiB, and whose answer may change what the guest sees and nothing of the host.

The guest that sees a hook's change is test_launcher_windows.py's bare VMI (a disk serial the hook
adds); a root launcher's run is refused here before anything boots.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from launcher.render.domain import Host, ResolvedDisk, render
from launcher.render.hookcheck import HookRefused, check
from launcher.runtime import hooks as runner
from launcher.runtime.vmuser import BLOCK, runs_anything
from launcher.spec.fields import SpecError
from launcher.spec.gates import parse_gates
from launcher.spec.hooks import ANNOTATION, sidecars
from launcher.spec.vmi import parse_vmi
from tests import libvmi
from tests.test_launcher_console import as_root_here
from tests.testguest import ensure_testguest
from tests.vmhost import QEMU_UID, qemu_scratch

GATED = parse_gates(["Sidecar"])
ON_DEFINE = {"args": ["--version", "v1alpha2"], "configMap": {"name": "my-config-map", "key": "my_script.sh", "hookPath": "/usr/bin/onDefineDomain"}}
HOOK_UID = 1000 * BLOCK + QEMU_UID  # the last VM slot's uid, which no VM of the suite reaches: the hooks run directly here


def _annotated(*entries) -> dict:
    return {ANNOTATION: json.dumps(list(entries))}


# ---------------------------------------------------------------- admission

def test_without_the_sidecar_gate_the_annotation_is_refused_in_kubevirts_words():
    with pytest.raises(SpecError) as err:
        sidecars(_annotated(ON_DEFINE), parse_gates([]))
    assert str(err.value) == ("metadata.annotations: sidecar feature gate is not enabled in kubevirt-config, invalid entry"
                              " metadata.annotations[hooks.kubevirt.io/hookSidecars]")


def test_a_configmap_script_at_a_hook_point_is_a_hook():
    (hook,) = sidecars(_annotated(ON_DEFINE), GATED)
    assert (hook.point, hook.version, hook.config_map, hook.key) == ("onDefineDomain", "v1alpha2", "my-config-map", "my_script.sh")
    assert sidecars({}, parse_gates([])) == ()


@pytest.mark.parametrize("entry, field, message", [
    # sidecar_shim.go parseCommandLineArgs: the shim exits, virt-launcher never sees its socket
    ({**ON_DEFINE, "args": []}, "[0].args", "Missing --version parameter. Supported options are [v1alpha1 v1alpha2 v1alpha3]."),
    ({**ON_DEFINE, "args": ["--version", "v9"]}, "[0].args", "Version v9 is not supported. Supported options are [v1alpha1 v1alpha2 v1alpha3]."),
    # a sidecar image of the user's own (examples/vmi-with-sidecar-hook.yaml): no container engine runs it here
    ({"args": ["--version", "v1alpha2"], "image": "registry:5000/kubevirt/example-hook-sidecar:devel"}, "[0].image",
     "a sidecar image other than KubeVirt's sidecar-shim is not supported by the launcher (it runs ConfigMap scripts as the sidecar-shim does)"),
    ({**ON_DEFINE, "pvc": {"name": "c", "volumePath": "/x"}}, "[0].pvc",
     "a hook sidecar's claim is not supported by the launcher (it runs ConfigMap scripts as the sidecar-shim does)"),
    # the shim's exec.LookPath finds only these two names in its PATH: anything else is never run
    ({**ON_DEFINE, "configMap": {**ON_DEFINE["configMap"], "hookPath": "/opt/hook.sh"}}, "[0].configMap.hookPath",
     "/opt/hook.sh: the sidecar-shim runs only onDefineDomain and preCloudInitIso from its PATH (/usr/bin/onDefineDomain,"
     " /usr/bin/preCloudInitIso): this script would never run"),
    # pkg/hooks/manager.go calls PreCloudInitIso for v1alpha2 and v1alpha3 only
    ({"args": ["--version", "v1alpha1"], "configMap": {**ON_DEFINE["configMap"], "hookPath": "/usr/bin/preCloudInitIso"}}, "[0].args",
     "preCloudInitIso needs --version v1alpha2 or v1alpha3: KubeVirt never calls it under v1alpha1"),
    # what KubeVirt would run and the launcher does not: refused, as it changes what the guest's cloud-init sees
    ({"args": ["--version", "v1alpha3"], "configMap": {**ON_DEFINE["configMap"], "hookPath": "/usr/bin/preCloudInitIso"}}, "[0].configMap.hookPath",
     "preCloudInitIso hooks are not supported by the launcher (it runs onDefineDomain hooks)"),
])
def test_what_the_shim_would_not_run_is_refused_in_one_line(entry, field, message):
    with pytest.raises(SpecError) as err:
        sidecars(_annotated(entry), GATED)
    assert str(err.value) == f"metadata.annotations[{ANNOTATION}]{field}: {message}"


def test_an_annotation_that_is_not_json_is_refused():
    with pytest.raises(SpecError, match=r"hookSidecars\]: not a JSON list of hook sidecars"):
        sidecars({ANNOTATION: "[{"}, GATED)


# ---------------------------------------------------------------- what a hook may answer

def _rendered() -> str:
    vmi = parse_vmi(libvmi.new("hooked", libvmi.with_container_disk("root", "r/x:1"), libvmi.with_claim("data", "data"),
                               libvmi.with_memory("128Mi")))
    disks = {"root": ResolvedDisk("/run/vm/root/disk.qcow2", "qcow2", backing=("/cache/root.img", "raw")),
             "data": ResolvedDisk("/pvc/data/disk.img", "raw")}
    return render(vmi, disks, Host(serial_log="/run/vm/console.log"))


def _edit(xml: str, change) -> str:
    root = ET.fromstring(xml)
    change(root)
    return ET.tostring(root, encoding="unicode")


def _disk(root: ET.Element, alias: str) -> ET.Element:
    return next(d for d in root.iter("disk") if d.find("alias").get("name") == f"ua-{alias}")


def _add(parent: ET.Element, tag: str, text: str | None = None, **attrs) -> ET.Element:
    child = ET.SubElement(parent, tag, attrs)
    child.text = text
    return child


def _serial(root):
    _add(_disk(root, "root"), "serial", "hooked")


def _smbios(root):
    sysinfo = root.find("sysinfo") or _add(root, "sysinfo", type="smbios")
    board = sysinfo.find("baseBoard") or _add(sysinfo, "baseBoard")
    _add(board, "entry", "Radical Edward", name="manufacturer")  # the user guide's hook


@pytest.mark.parametrize("change", [_serial, _smbios, lambda root: root.find("devices").remove(_disk(root, "data"))],
                         ids=["disk-serial", "smbios-entry", "drop-a-disk"])
def test_a_hook_may_change_what_the_guest_sees(change):
    rendered = _rendered()
    check(rendered, _edit(rendered, change))


def _host_disk(root):
    disk = _add(root.find("devices"), "disk", type="file", device="disk")
    _add(disk, "source", file="/etc/shadow")
    _add(disk, "target", dev="vdz", bus="virtio")


def _resource(root, path, **attrs):
    root.find(path).attrib.update(attrs)


@pytest.mark.parametrize("change, why", [
    (_host_disk, "adds a <disk of type file> device or changes what one uses on the host (its source, backend or format)"),
    (lambda root: _disk(root, "data").find("source").set("file", "/pvc/other/disk.img"),
     "adds a <disk of type file> device or changes what one uses on the host (its source, backend or format)"),
    # a raw claim read as qcow2 would follow a backing file the guest wrote into its header
    (lambda root: _disk(root, "data").find("driver").set("type", "qcow2"),
     "adds a <disk of type file> device or changes what one uses on the host (its source, backend or format)"),
    (lambda root: _add(root.find("devices"), "interface", type="user"),
     "adds a <interface of type user> device or changes what one uses on the host (its source, backend or format)"),
    (lambda root: _add(root.find("devices"), "graphics", type="vnc", port="5900", listen="0.0.0.0"),
     "adds a <graphics of type vnc> device or changes what one uses on the host (its source, backend or format)"),
    (lambda root: _add(root.find("devices"), "hostdev", mode="subsystem", type="usb"),
     "adds a <hostdev of type usb> device or changes what one uses on the host (its source, backend or format)"),
    (lambda root: root.find("devices/emulator").__setattr__("text", "/tmp/evil") if root.find("devices/emulator") is not None
     else _add(root.find("devices"), "emulator", "/tmp/evil"), "changes <devices/emulator>, which the launcher sets for this host"),
    (lambda root: _add(_add(root, "{http://libvirt.org/schemas/domain/qemu/1.0}commandline"),
                       "{http://libvirt.org/schemas/domain/qemu/1.0}arg", value="-nic"),
     "adds or changes elements or attributes of another namespace (qemu:commandline, qemu:override), which pass anything to qemu"),
    (lambda root: _add(root, "seclabel", type="none"), "changes <seclabel>, which the launcher sets for this host"),
    (lambda root: _add(root.find("os"), "kernel", "/boot/vmlinuz"), "changes <os/kernel>, which the launcher sets for this host"),
    (lambda root: root.set("type", "kvm"), "changes the domain type (qemu to kvm): the launcher chose the accelerator"),
    (lambda root: root.find("name").__setattr__("text", "other"), "changes the domain's <name>, by which the launcher knows its VM"),
    (lambda root: _resource(root, "memory", unit="GiB") or root.find("memory").__setattr__("text", "64"),
     "asks for more <memory> than the spec (68719476736 bytes)"),
    (lambda root: _add(root, "description", "see /root/.ssh/id_rsa"), "names a host path the launcher did not give the VM: /root/.ssh/id_rsa"),
], ids=["new-host-file", "other-claim", "raw-as-qcow2", "slirp-nic", "vnc-on-tcp", "usb-hostdev", "emulator", "qemu-commandline",
        "no-seclabel", "kernel", "kvm", "name", "memory", "any-path"])
def test_a_hook_may_not_reach_the_host(change, why):
    rendered = _rendered()
    with pytest.raises(HookRefused) as err:
        check(rendered, _edit(rendered, change))
    assert str(err.value) == why


def test_a_hooks_entities_are_never_expanded():
    rendered = _rendered()
    hostile = '<!DOCTYPE domain [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">]>' + rendered
    with pytest.raises(HookRefused, match="DOCTYPE"):
        check(rendered, hostile)


# ---------------------------------------------------------------- the script, run

def _run(script: str, *args: str, timeout: float = runner.TIMEOUT, limit: int = runner.ANSWER_MAX) -> bytes:
    return runner.run_script(script.encode(), "onDefineDomain", list(args), (HOOK_UID, HOOK_UID), "hook", timeout=timeout, limit=limit)


def test_the_script_gets_the_shims_arguments_and_runs_as_the_vms_uid_without_privileges():
    out = _run('#!/bin/sh\necho "$1 $2 $3 $4 uid=$(id -u) gid=$(id -g) groups=$(id -G)"; grep -E "^(CapEff|NoNewPrivs)" /proc/self/status\n',
               "--vmi", "{}", "--domain", "<domain/>")
    lines = out.decode().splitlines()
    assert lines[0] == f"--vmi {{}} --domain <domain/> uid={HOOK_UID} gid={HOOK_UID} groups={HOOK_UID}"
    assert sorted(" ".join(line.split()) for line in lines[1:]) == ["CapEff: 0000000000000000", "NoNewPrivs: 1"]


def test_the_user_guides_python_hook_writes_its_own_tmp_not_the_hosts():
    # docs/user_workloads/hook-sidecar.md's Python example writes /tmp/orig.xml and /tmp/new.xml, as in its container
    script = ("#!/usr/bin/env python3\nimport sys\nopen('/tmp/orig.xml', 'w').write(sys.argv[4])\n"
              "print(open('/tmp/orig.xml').read())\n")
    host_file = Path("/tmp/orig.xml")
    before = host_file.exists() and host_file.read_bytes()
    assert _run(script, "--vmi", "{}", "--domain", "<domain/>") == b"<domain/>\n"
    assert (host_file.exists() and host_file.read_bytes()) == before


def test_a_hook_that_hangs_is_ended_with_all_it_started():
    script = "#!/bin/sh\n(setsid sleep 600 &)\necho 'waiting for nothing' >&2\nsleep 600\n"
    with pytest.raises(runner.HookFailed) as err:
        _run(script, timeout=3)
    assert str(err.value) == ("hook: the onDefineDomain hook did not answer within 3 s (KubeVirt's limit for a hook call);"
                              " it said: waiting for nothing")
    assert not runs_anything(HOOK_UID)


def test_a_hook_that_floods_is_ended_at_the_answers_bound():
    with pytest.raises(runner.HookFailed) as err:
        _run("#!/bin/sh\n(sleep 600 &)\nexec yes\n", limit=1 << 20)
    assert str(err.value) == "hook: the onDefineDomain hook answered more than 1 MiB (a hook's answer is one gRPC message)"
    assert not runs_anything(HOOK_UID)


def test_a_hook_that_leaves_a_process_behind_leaves_nothing():
    assert _run("#!/bin/sh\n(setsid sleep 600 </dev/null >/dev/null 2>&1 &)\necho done\n") == b"done\n"
    assert not runs_anything(HOOK_UID)


def test_a_hook_never_runs_as_root():
    with pytest.raises(runner.HookFailed, match="would run as root"):
        runner.run_script(b"#!/bin/sh\n", "onDefineDomain", [], (0, 0), "hook")


# ---------------------------------------------------------------- a root launcher's run

@pytest.fixture(scope="module")
def root_run():
    """A root launcher, no system daemon: the VM's own uid; the containerDisk as the pod mounts it."""
    with qemu_scratch("diskkit-hooks-") as scratch:
        mounts = scratch / "mounts" / "disk_0" / "disk"
        mounts.mkdir(parents=True)
        shutil.copy(ensure_testguest() / "testguest.qcow2", mounts / "testguest.qcow2")
        (scratch / "manifests").mkdir()

        def run(script: str):
            (scratch / "manifests" / "cm.json").write_text(json.dumps({
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "my-config-map"}, "data": {"my_script.sh": script}}))
            vmi = libvmi.new("hooked", libvmi.with_container_disk("root", "127.0.0.1:9/nowhere/guest:v1"), libvmi.with_memory("128Mi"))
            vmi["metadata"]["annotations"] = _annotated(ON_DEFINE)
            path = libvmi.write(vmi, scratch)
            cache = scratch / "cache"
            return subprocess.run(as_root_here(cache, "run", "--container-disk-dir", scratch / "mounts", "--manifests", scratch / "manifests",
                                               "--feature-gates", "Sidecar", "--timeout", "120", path),
                                  capture_output=True, text=True, timeout=200, env={**os.environ, "CI": "true"}), cache
        yield run


def _refusal(result) -> str:
    assert result.returncode != 0, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"launcher: metadata.annotations[{ANNOTATION}][0]: "), result.stderr
    assert "Traceback" not in result.stderr
    return line


def test_a_root_launchers_hook_runs_as_the_vms_own_uid(root_run):
    result, cache = root_run('#!/bin/sh\necho "hook uid=$(id -u)" >&2\nexit 1\n')
    line = _refusal(result)
    uid = int(line.rsplit("hook uid=", 1)[1])
    assert uid != 0 and uid % BLOCK == QEMU_UID and uid >= BLOCK  # a VM slot's uid (launcher.runtime.vmuser)
    assert "the onDefineDomain hook exited with status 1" in line
    assert not (cache / "vms" / "default_hooked.json").exists() and not any((cache / "run").glob("*hooked*"))


def test_a_root_launchers_hook_that_asks_for_a_host_file_starts_nothing(root_run):
    shadow = os.stat("/etc/shadow")
    script = ("#!/bin/sh\nprintf '%s' \"$4\" | sed \"s|</devices>|<disk type='file' device='disk'><source file='/etc/shadow'/>"
              "<target dev='vdz' bus='virtio'/></disk></devices>|\"\n")
    result, cache = root_run(script)
    assert _refusal(result).endswith("the onDefineDomain hook's domain adds a <disk of type file> device or changes what one uses"
                                     " on the host (its source, backend or format)")
    after = os.stat("/etc/shadow")
    assert (after.st_uid, after.st_gid, after.st_mode) == (shadow.st_uid, shadow.st_gid, shadow.st_mode)
    assert not (cache / "vms" / "default_hooked.json").exists()
