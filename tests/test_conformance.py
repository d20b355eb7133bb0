"""Conformance corpus: KubeVirt's and CDI's own specs, each with what KubeVirt does with it.

Every document in tests/conformance/*.yaml is one case, written from a KubeVirt or CDI source
(`x-source`: the file, and the line for tests) and holding what KubeVirt does with it:

- `x-expect-refusal`: the launcher's one line `field: message`. `FIELD: unsupported` and
  `FIELD: unknown` stand for launcher.spec.coverage's two rules; such a case must also say what the
  rest of the VM renders to with `--ignore-unsupported` (`x-expect-xml`), as KubeVirt renders it, or
  what KubeVirt refuses in the rest (`x-expect-ignored-refusal`).
- `x-expect-xml`: the domain's relevant parts. `disks` maps each disk (by name) to the attributes
  compared (device, type, bus, dev, model, driver{...}, readonly, shareable, serial, boot, blockio{...},
  tray, address{...}); `order` is the disks' names in document order; `controllers` is every
  controller as `type:model`; `elements` maps an ElementTree path to its attributes (`text`: its text; null: absent).
- `x-expect-datavolume`: for a CDI DataVolume, the parsed fields compared.
- `x-resolved` (volume -> ResolvedDisk fields) overrides the fixed fake files each volume kind gets;
  `x-host` sets Host fields; `x-pending` marks cases that flip when instancetypes or virtiofs land;
  `x-gates` turns on the feature gates a case's KubeVirt config does (--feature-gates names).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from diskkit.errors import DiskkitError
from launcher.render.domain import Host, ResolvedDisk, render
from launcher.spec.k8s import NetworkSource
from launcher.spec import coverage, hooks
from launcher.spec.datavolume import parse_data_volume
from launcher.spec.gates import admit_downward_metrics, admit_persistent_reservation, parse_gates
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
from tests.conftest import run_launcher

CORPUS = Path(__file__).parent / "conformance"
SHORTHAND = {"unsupported": coverage.UNSUPPORTED_RULE, "unknown": coverage.UNKNOWN_RULE}
PENDING = ()  # areas a case waits for; none left
KEYS = {"x-source", "x-expect-refusal", "x-expect-xml", "x-expect-datavolume", "x-expect-ignored-refusal",
        "x-resolved", "x-host", "x-pending", "x-objects", "x-gates"}


def _cases() -> list:
    out = []
    for path in sorted(CORPUS.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            name = (doc.get("metadata") or {}).get("name", "")
            out.append(pytest.param(doc, id=f"{path.stem}[{i}]-{name}"))
    return out


CASES = _cases()


def _expected_refusal(text: str) -> str:
    field, _, rule = text.rpartition(": ")
    return f"{field}: {SHORTHAND[rule]}" if rule in SHORTHAND else text


def _fake_disk(volume: dict) -> ResolvedDisk:
    """What launcher.volumes would resolve each volume kind to, at fixed fake paths."""
    name = volume["name"]
    if "containerDisk" in volume or "ephemeral" in volume:
        return ResolvedDisk(f"/run/vm/{name}/disk.qcow2", "qcow2", backing=(f"/cache/{name}.img", "raw"))
    if "emptyDisk" in volume:
        return ResolvedDisk(f"/run/vm/{name}/disk.qcow2", "qcow2")
    if any(k in volume for k in ("persistentVolumeClaim", "dataVolume")):
        return ResolvedDisk(f"/pvc/{name}/disk.img", "raw")
    if "hostDisk" in volume:
        return ResolvedDisk(volume["hostDisk"].get("path") or f"/host/{name}.img", "raw")
    return ResolvedDisk(f"/run/vm/{name}.iso", "raw")  # generated ISOs and the downwardMetrics disk


def _volumes(doc: dict) -> list:
    spec = doc.get("spec") or {}
    if doc.get("kind") == "VirtualMachine":
        spec = (spec.get("template") or {}).get("spec") or {}
    return [v for v in spec.get("volumes") or [] if isinstance(v, dict) and isinstance(v.get("name"), str)]


def _resolved(doc: dict, overrides: dict) -> dict:
    disks = {v["name"]: _fake_disk(v) for v in _volumes(doc)}
    for name, fields in (overrides or {}).items():
        if fields.get("backing"):
            fields = {**fields, "backing": tuple(fields["backing"])}
        if fields.get("block_io"):
            fields = {**fields, "block_io": tuple(fields["block_io"])}
        if fields.get("network"):  # an iSCSI PV: NetworkSource fields, hosts as [host, port] pairs
            network = fields["network"]
            fields = {**fields, "network": NetworkSource(**{**network, "hosts": tuple(tuple(h) for h in network["hosts"])})}
        disks[name] = ResolvedDisk(**fields)
    return disks


def _host(doc: dict, fields: dict) -> Host:
    fields = dict(fields or {})
    if "topology" in fields:
        fields["topology"] = tuple(tuple(tuple(core) for core in cell) for cell in fields["topology"])
        fields["cpuset"] = tuple(fields["cpuset"])
    text = json.dumps(doc, default=str)  # the C encoder: the broken-spec walk asks this of ~14,000 specs
    if '"kernelPath"' in text:
        fields.setdefault("kernel", "/run/vm/kernel")
    if '"initrdPath"' in text:
        fields.setdefault("initrd", "/run/vm/initrd")
    if '"efi":' in text:  # what launcher.volumes.vmstate finds in Debian's ovmf, and the VM's own variable store
        secure = "OVMF_VARS_4M.fd" if '"secureBoot": false' in text else "OVMF_VARS_4M.ms.fd"
        fields.setdefault("efi_code", "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
        fields.setdefault("efi_vars", f"/usr/share/OVMF/{secure}")
        fields.setdefault("nvram", "/run/vm/nvram/VARS.fd")
    spec = doc.get("spec") or {}
    if doc.get("kind") == "VirtualMachine":
        spec = (spec.get("template") or {}).get("spec") or {}
    shares = ((spec.get("domain") or {}).get("devices") or {}).get("filesystems") or []
    fields.setdefault("virtiofs_sockets", tuple((f["name"], f"/run/vm/virtiofs/{f['name']}.sock") for f in shares
                                                if isinstance(f, dict) and isinstance(f.get("name"), str)))
    return Host(**fields)


def _disk_summary(disk: ET.Element) -> dict:
    target, driver = disk.find("target"), disk.find("driver")
    boot, serial, blockio, address = disk.find("boot"), disk.find("serial"), disk.find("blockio"), disk.find("address")
    return {
        "device": disk.get("device"), "type": disk.get("type"), "model": disk.get("model"),
        "bus": target.get("bus"), "dev": target.get("dev"), "tray": target.get("tray"),
        "driver": dict(driver.attrib), "readonly": disk.find("readonly") is not None,
        "shareable": disk.find("shareable") is not None, "serial": None if serial is None else serial.text,
        "boot": None if boot is None else int(boot.get("order")),
        "blockio": None if blockio is None else {k: int(v) for k, v in blockio.attrib.items()},
        "address": None if address is None else dict(address.attrib),
    }


def _check_xml(xml: str, expected: dict) -> None:
    root = ET.fromstring(xml)
    disks = {d.find("alias").get("name").removeprefix("ua-"): _disk_summary(d) for d in root.iter("disk")}
    if "order" in expected:
        assert list(disks) == expected["order"]
    for name, want in (expected.get("disks") or {}).items():
        assert name in disks, f"no disk {name} in the domain: {list(disks)}"
        got = disks[name]
        for key, value in want.items():
            if key == "driver":
                assert {k: got["driver"].get(k) for k in value} == {k: None if v is None else str(v) for k, v in value.items()}, name
            else:
                assert got[key] == value, f"disk {name}: {key} is {got[key]!r}, KubeVirt gives {value!r}"
    if "controllers" in expected:
        got = [f"{c.get('type')}:{c.get('model')}" for c in root.find("devices").findall("controller")]
        assert got == expected["controllers"]
    for path, attrs in (expected.get("elements") or {}).items():
        element = root.find(path)
        if attrs is None:
            assert element is None, f"{path} is in the domain, KubeVirt has none"
        else:
            assert element is not None, f"{path} is missing"
            got = {k: element.text if k == "text" else element.get(k) for k in attrs}
            assert got == {k: None if v is None else str(v) for k, v in attrs.items()}, path


def _refusal(call) -> str:
    try:
        call()
    except DiskkitError as err:
        return str(err)
    pytest.fail("accepted, where KubeVirt refuses")


def test_corpus_is_big_and_every_case_is_sourced():
    assert len(CASES) >= 150
    for param in CASES:
        doc = param.values[0]
        assert doc.get("x-source"), param.id
        assert {"x-expect-refusal", "x-expect-xml", "x-expect-datavolume"} & set(doc), f"{param.id} expects nothing"
        assert not set(k for k in doc if k.startswith("x-")) - KEYS, f"{param.id}: unknown keys"
        assert doc.get("x-pending") in (None, *PENDING), param.id


@pytest.mark.parametrize("case", CASES)
def test_case(case):
    case = dict(case)
    meta = {k: case.pop(k) for k in list(case) if k.startswith("x-")}
    if case.get("kind") == "DataVolume":
        if "x-expect-refusal" in meta:
            assert _refusal(lambda: parse_data_volume(case, "DataVolume")) == _expected_refusal(meta["x-expect-refusal"])
        if "x-expect-datavolume" in meta:
            dv = parse_data_volume(case, "DataVolume")
            got = {"source": dv.source.kind, "url": dv.source.url, "size": dv.size, "volume_mode": dv.volume_mode,
                   "content_type": dv.content_type, "claim": dv.source.claim, "secret_ref": dv.source.secret_ref,
                   "cert_config_map": dv.source.cert_config_map, "storage_class": dv.storage_class}
            assert {k: got[k] for k in meta["x-expect-datavolume"]} == meta["x-expect-datavolume"]
        return
    disks, host = _resolved(case, meta.get("x-resolved")), _host(case, meta.get("x-host"))
    objects = Objects(meta.get("x-objects") or [])  # instance types and preferences, as --manifests gives them
    refusal = meta.get("x-expect-refusal")
    if refusal is not None:
        expected = _expected_refusal(refusal)
        assert _refusal(lambda: render(_admitted(case, objects, meta.get("x-gates", [])), disks, host)) == expected
        if expected.endswith((coverage.UNSUPPORTED_RULE, coverage.UNKNOWN_RULE)):
            assert {"x-expect-xml", "x-expect-ignored-refusal"} & set(meta), "a field the launcher drops: say what the rest renders to"
    if "x-expect-ignored-refusal" in meta:
        got = _refusal(lambda: render(parse_vmi(case, ignore_unsupported=True, objects=objects), disks, host))
        assert got == _expected_refusal(meta["x-expect-ignored-refusal"])
    if "x-expect-xml" in meta:
        vmi = parse_vmi(case, ignore_unsupported=refusal is not None, objects=objects)
        if refusal is None and "x-gates" in meta:  # admitted with them
            _admitted(case, objects, meta["x-gates"])
        _check_xml(render(vmi, disks, host), meta["x-expect-xml"])
    try:  # whatever else happens to it, a KubeVirt spec ends in a domain or in one line, never a traceback
        render(parse_vmi(case, ignore_unsupported=True, objects=objects), disks, host)
    except DiskkitError as err:
        assert "\n" not in str(err)


def _admitted(case: dict, objects: Objects, gates: list[str] = ()):
    """The VMI as the launcher admits it before anything runs: its spec, its hook sidecars, its
    downward metrics and its persistent reservations under KubeVirt's default gates (all off) or the
    case's `x-gates` (--feature-gates), as virt-api's admitter takes them."""
    vmi = parse_vmi(case, objects=objects)
    hooks.sidecars(vmi.annotations, parse_gates(gates), vmi.from_vm)
    admit_downward_metrics(vmi, parse_gates(gates))
    admit_persistent_reservation(vmi, parse_gates(gates))
    return vmi


def test_refusals_are_one_line_from_the_cli(tmp_path):
    """`launcher domain` refuses before it pulls anything: one line, exit 1, never a traceback."""
    checked = 0
    for param in CASES:
        doc = param.values[0]
        if doc.get("kind") == "DataVolume" or "x-expect-refusal" not in doc or "x-expect-xml" in doc:
            continue
        spec = {k: v for k, v in doc.items() if not k.startswith("x-")}
        objects = doc.get("x-objects") or []
        try:
            parse_vmi(spec, objects=Objects(objects))
            continue  # refused when rendering with its resolved files, which `domain` pulls first
        except DiskkitError:
            pass
        path = tmp_path / "vmi.yaml"
        path.write_text(yaml.safe_dump(spec))
        manifests = []
        if objects:
            (tmp_path / "manifests").mkdir(exist_ok=True)
            (tmp_path / "manifests" / "objects.yaml").write_text(yaml.safe_dump_all(objects))
            manifests = ["--manifests", str(tmp_path / "manifests")]
        proc = run_launcher("domain", "--cache-dir", tmp_path / "cache", *manifests, path, timeout=60)
        assert proc.code == 1, (param.id, proc.err)
        assert "Traceback" not in proc.err and len(proc.err.strip().splitlines()) == 1, (param.id, proc.err)
        assert _expected_refusal(doc["x-expect-refusal"]) in proc.err, (param.id, proc.err)
        checked += 1
    assert checked > 0


def _leaf_paths(value, path=()):
    if path:
        yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _leaf_paths(child, path + (key,))


DELETED = object()


def _copied(value):
    """A copy of a tree of dicts, lists and scalars (what YAML gives): copy.deepcopy's without its memo, a fifth of this file's time."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


@pytest.mark.slow  # every field of every case broken two ways: twenty seconds of CPU
def test_broken_corpus_specs_fail_in_one_line():
    """Every field of every case, removed or replaced by a value of the wrong type: a domain or one DiskkitError line."""
    tracebacks = []
    for param in CASES:
        doc = param.values[0]
        case = {k: v for k, v in doc.items() if not k.startswith("x-")}
        for path in _leaf_paths(case):
            for wrong in (None, 5, "x", [], {"a": 1}, "1e400", DELETED):
                broken = _copied(case)
                parent = broken
                for key in path[:-1]:
                    parent = parent[key]
                if wrong is DELETED:
                    parent.pop(path[-1])
                else:
                    parent[path[-1]] = wrong
                for ignore in (False, True):
                    try:
                        if broken.get("kind") == "DataVolume":
                            parse_data_volume(broken, "DataVolume")
                        else:
                            render(parse_vmi(broken, ignore_unsupported=ignore, objects=Objects(doc.get("x-objects") or [])),
                                   _resolved(broken, doc.get("x-resolved")),
                                   _host(broken, doc.get("x-host")))
                    except DiskkitError as err:
                        assert "\n" not in str(err)
                    except Exception as err:  # noqa: BLE001 - the point is to catch any
                        tracebacks.append(f"{param.id} {'.'.join(map(str, path))}={wrong!r}: {type(err).__name__}: {err}")
    assert not tracebacks, "\n".join(tracebacks[:20])
