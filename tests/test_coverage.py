"""Nothing in a manifest is dropped silently: every field is implemented, inert, or refused by name
(launcher.spec.coverage), and --ignore-unsupported drops only what it names."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from launcher.spec import coverage
from launcher.spec.fields import SpecError
from launcher.spec.vmi import VOLUME_KINDS, parse_vmi

ROOT = Path(__file__).resolve().parent.parent
UNSUPPORTED = coverage.UNSUPPORTED_RULE
UNKNOWN = coverage.UNKNOWN_RULE


def vmi(**devices):
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "v"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [], **devices}},
                     "volumes": [{"name": "root", "containerDisk": {"image": "x/y:1"}},
                                 {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}}


def refusal(doc) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    return str(err.value)


def test_every_volume_kind_the_parser_knows_has_a_shape():
    assert set(VOLUME_KINDS) <= set(coverage.VOLUME)


def _vm_documents(path: Path):
    """The VMs and VMIs of a file, also those a ConfigMap carries as a value (examples/kubernetes)."""
    for doc in yaml.safe_load_all(path.read_text()):
        if not isinstance(doc, dict):
            continue
        for key in ("x-resolved", "x-host"):
            doc.pop(key, None)
        if doc.get("kind") == "ConfigMap":
            for value in (doc.get("data") or {}).values():
                inner = yaml.safe_load(value)
                if isinstance(inner, dict) and inner.get("kind") in ("VirtualMachineInstance", "VirtualMachine"):
                    yield inner
        elif doc.get("kind") in ("VirtualMachineInstance", "VirtualMachine"):
            yield doc


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in
                                        [*ROOT.glob("tests/golden/domain/*.yaml"), *ROOT.glob("examples/**/*.yaml")]))
def test_the_projects_own_manifests_use_nothing_unsupported(path):
    for doc in _vm_documents(ROOT / path):
        assert coverage.unsupported_fields(doc) == [], path


# (where in the doc, value, field path named in the refusal, rule)
CASES = [
    (("spec", "domain", "devices", "watchdog"), {"name": "w", "i6300esb": {}}, "spec.domain.devices.watchdog", UNSUPPORTED),
    (("spec", "domain", "devices", "rng"), {"model": "x"}, "spec.domain.devices.rng.model", UNKNOWN),
    (("spec", "domain", "devices", "autoattachVSOCK"), True, "spec.domain.devices.autoattachVSOCK", UNSUPPORTED),
    (("spec", "domain", "devices", "sound"), {"name": "s"}, "spec.domain.devices.sound", UNSUPPORTED),
    (("spec", "domain", "memory"), {"maxGuest": "2Gi"}, "spec.domain.memory.maxGuest", UNSUPPORTED),
    (("spec", "domain", "cpu"), {"cores": 2, "features": [{"name": "vmx"}]}, "spec.domain.cpu.features", UNSUPPORTED),
    (("spec", "domain", "memory"), {"hugepages": {"pageSize": "2Mi"}}, "spec.domain.memory.hugepages", UNSUPPORTED),
    (("spec", "accessCredentials"), [{"userPassword": {}}], "spec.accessCredentials[0].userPassword", UNSUPPORTED),
    (("spec", "startStrategy"), "Paused", "spec.startStrategy", UNSUPPORTED),
    # the schema spells it "readonly" (schema.go DiskTarget); KubeVirt's API server drops "readOnly"
    (("spec", "domain", "devices", "disks"), [{"name": "root", "disk": {"readOnly": True}}], "spec.domain.devices.disks[0].disk.readOnly",
     UNKNOWN.replace("unknown field", "unknown field (did you mean \"readonly\"?)")),
    (("spec", "domain", "devicez"), {}, "spec.domain.devicez", UNKNOWN.replace("unknown field", "unknown field (did you mean \"devices\"?)")),
]


def _with(path, value):
    doc = vmi()
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,field,rule", CASES, ids=[c[2] for c in CASES])
def test_what_the_launcher_does_not_implement_is_refused_by_name(path, value, field, rule):
    assert refusal(_with(path, value)) == f"{field}: {rule}"


@pytest.mark.parametrize("path,value,field,rule", CASES, ids=[c[2] for c in CASES])
def test_ignore_unsupported_drops_exactly_what_it_names(path, value, field, rule):
    doc = _with(path, value)
    kept = parse_vmi(copy.deepcopy(doc), ignore_unsupported=True)
    assert kept.ignored == ((field, rule),)
    assert kept.domain == parse_vmi(coverage.without(doc, [field]), ignore_unsupported=False).domain


def test_inert_fields_change_nothing():
    doc = vmi(logSerialConsole=False, autoattachPodInterface=False)
    doc["spec"].update(nodeSelector={"a": "b"}, tolerations=[], terminationGracePeriodSeconds=0, evictionStrategy="None",
                       readinessProbe={"exec": {"command": ["true"]}})
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "tag": "boot", "disk": {"bus": "virtio"}}]
    assert parse_vmi(doc).ignored == ()


def test_a_virtual_machines_template_is_walked_too():
    inner = vmi(watchdog={"name": "w", "i6300esb": {}})
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "v"},
          "spec": {"runStrategy": "Always", "template": {"metadata": {"labels": {"a": "b"}}, "spec": inner["spec"]}}}
    assert refusal(vm) == f"spec.template.spec.domain.devices.watchdog: {UNSUPPORTED}"
    vm["spec"]["running"] = True
    assert parse_vmi(vm, ignore_unsupported=True).ignored[0][0] == "spec.template.spec.domain.devices.watchdog"


def test_the_cli_refuses_then_names_each_field_it_drops(tmp_path):
    from tests.conftest import run_launcher

    doc = vmi(sound={"name": "s"}, watchdog={"name": "w", "i6300esb": {}})
    doc["spec"]["volumes"] = [{"name": "scratch", "emptyDisk": {"capacity": "64Mi"}}]
    spec = tmp_path / "vmi.yaml"
    spec.write_text(yaml.safe_dump(doc))
    env = {"DISKKIT_CACHE": str(tmp_path / "cache"), "DISKKIT_ACCEL": "qemu"}
    refused = run_launcher("domain", spec, env=env)
    assert refused.code != 0 and refused.err.strip().splitlines() == [f"launcher: spec.domain.devices.sound: {UNSUPPORTED}"]
    went_on = run_launcher("domain", "--ignore-unsupported", spec, env=env)
    assert went_on.code == 0, went_on.err
    assert went_on.err.splitlines()[:2] == [
        "launcher: ignoring spec.domain.devices.sound: not supported by the launcher, and it changes what the guest sees",
        "launcher: ignoring spec.domain.devices.watchdog: not supported by the launcher, and it changes what the guest sees",
    ]
    assert "<domain" in went_on.out and "<sound" not in went_on.out and "watchdog" not in went_on.out
