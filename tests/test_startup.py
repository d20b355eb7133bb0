"""What a CLI run imports before it does anything: the signing stack (cryptography, nacl, yaml)
costs ~0.09 s of every run, so it loads only when a command signs or a policy names keys; zstd
only when a layer is zstd; a command's implementation only when it runs; the HTTP client only when
a URL or a registry is read; YAML, pycdlib and the VMI code only when a launcher command needs them.
The suite starts thousands of these processes, so what every one of them imports counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SIGNING_ONLY = ("cryptography", "nacl", "yaml", "diskkit.signing.keys", "diskkit.signing.sigstore", "diskkit.signing.registriesd")
ROOT = Path(__file__).resolve().parent.parent


def _loaded(code: str) -> set[str]:
    """Top packages and diskkit modules in sys.modules after `code` runs in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    return {n for n in names if n.startswith("diskkit.")} | {n.split(".")[0] for n in names}


def test_cli_help_loads_no_signing_module():
    loaded = _loaded("from click.testing import CliRunner\nfrom diskkit.cli.commands import cli\n"
                     "assert CliRunner().invoke(cli, ['--help']).exit_code == 0")
    assert "diskkit.cli.commands" in loaded
    assert sorted(loaded.intersection(SIGNING_ONLY)) == []


def test_policy_accepting_anything_loads_no_key_code(tmp_path):
    # A pull under the stock policy.json (insecureAcceptAnything) goes through enforce_source.
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    loaded = _loaded("from pathlib import Path\nfrom diskkit.signing.options import TrustOptions\nfrom diskkit.signing.trust import load_policy\n"
                     f"assert load_policy(TrustOptions(Path({str(policy)!r}))) is not None")
    assert "diskkit.signing.trust" in loaded
    assert sorted(loaded.intersection(SIGNING_ONLY)) == []


def test_policy_with_keys_still_loads_them(tmp_path):
    """The other side: the lazy import is taken when a requirement names a key."""
    key = subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout"], capture_output=True, check=True).stdout
    pub = subprocess.run(["openssl", "ec", "-pubout"], input=key, capture_output=True, check=True).stdout
    (tmp_path / "k.pub").write_bytes(pub)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "sigstoreSigned", "keyPath": str(tmp_path / "k.pub")}]}))
    loaded = _loaded("from pathlib import Path\nfrom diskkit.signing.options import TrustOptions\nfrom diskkit.signing.trust import load_policy\n"
                     f"assert load_policy(TrustOptions(Path({str(policy)!r}))).default[0].keys")
    assert {"cryptography", "diskkit.signing.keys"} <= loaded


def test_a_gzip_build_loads_no_zstd_and_a_zstd_build_does(tmp_path):
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(1 << 20))
    for kind, expected in (("gzip", False), ("zstd", True)):
        loaded = _loaded("from click.testing import CliRunner\nfrom diskkit.cli.commands import cli\n"
                         f"r = CliRunner().invoke(cli, ['build', {str(disk)!r}, '--compression', {kind!r}, '-t', 'oci:{tmp_path}/{kind}:x'])\n"
                         "assert r.exit_code == 0, r.output")
        assert ("zstandard" in loaded) == expected, kind


# What the suite and users run most, as they run it (`python -m diskkit|launcher ...`), and what each
# must not load: the HTTP client (requests, urllib3: ~60 ms) for a local image or a local disk; a
# command's implementation for --version and --help; the YAML parser, pycdlib, libvirt and the VMI
# spec and renderer for launcher commands that read no VMI or make no disk of one.
HTTP = ("requests", "urllib3", "diskkit.source.httpfile", "diskkit.registry.client", "diskkit.transports.remote")
COMMANDS = ("diskkit.ops.build", "diskkit.ops.verify", "diskkit.ops.copy")
VMI_ONLY = ("yaml", "pycdlib", "libvirt", "launcher.spec.vmi", "launcher.render.domain")


def _imports_of(*argv, code: int | None = 0) -> set[str]:
    """Every module a real `python -m ...` run imported (-X importtime's list), and their top packages."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", *map(str, argv)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "CI": "true"})
    assert code is None or proc.returncode == code, proc.stderr[-3000:]
    names = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")} - {"imported package"}
    return names | {n.split(".")[0] for n in names}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A disk built into an OCI layout by the command under test, its imports, and a VMI booting it."""
    root = tmp_path_factory.mktemp("startup")
    disk = root / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(disk), "16M"], check=True)
    layout = f"oci:{root}/layout:v1"
    built = _imports_of("diskkit", "build", disk, "-t", layout)
    vmi = root / "vmi.yaml"
    vmi.write_text(f"""apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: startup}}
spec:
  domain:
    devices: {{disks: [{{name: root, disk: {{bus: virtio}}}}]}}
    resources: {{requests: {{memory: 128Mi}}}}
  volumes: [{{name: root, containerDisk: {{image: "{layout}"}}}}]
""")
    return {"root": root, "layout": layout, "built": built, "vmi": vmi, "cache": root / "cache"}


def test_diskkit_version_and_help_load_no_command():
    for argv in (("--version",), ("inspect", "--help"), ("build", "--help")):
        loaded = _imports_of("diskkit", *argv)
        assert "diskkit.cli.commands" in loaded
        assert sorted(loaded.intersection(HTTP + COMMANDS + SIGNING_ONLY)) == [], argv


def test_a_local_build_loads_no_http_client(local):
    assert "diskkit.ops.build" in local["built"]
    assert sorted(local["built"].intersection(HTTP + SIGNING_ONLY)) == []


@pytest.mark.parametrize("argv", [("verify", "{layout}"), ("inspect", "{layout}"), ("copy", "{layout}", "oci:{root}/copy:v1"),
                                  ("push", "{layout}", "oci-archive:{root}/pushed.tar:v1")], ids=lambda a: a[0])
def test_reading_a_local_image_loads_no_http_client(local, argv):
    loaded = _imports_of("diskkit", *(a.format(**local) for a in argv))
    assert sorted(loaded.intersection(HTTP)) == []


def test_reading_a_registry_still_loads_it(local):
    """The other side: the import is taken where a registry is read (nothing answers on port 1)."""
    loaded = _imports_of("diskkit", "inspect", "--retry-times", "0", "docker://127.0.0.1:1/startup:v1", code=None)
    assert {"requests", "diskkit.transports.remote"} <= loaded


@pytest.mark.parametrize("argv, code", [(("--version",), 0), (("pull", "--cache-dir", "{cache}", "{layout}"), 0),
                                        (("serve", "--status", "--cache-dir", "{cache}"), 1),  # no server runs: exit 1
                                        (("dv", "token", "--cache-dir", "{cache}", "startup"), 0)], ids=["version", "pull", "serve-status", "dv-token"])
def test_launcher_commands_without_a_vmi_load_no_vmi_code(local, argv, code):
    loaded = _imports_of("launcher", *(str(a).format(**local) for a in argv), code=code)
    assert sorted(loaded.intersection(VMI_ONLY)) == []


def test_launcher_domain_loads_no_iso_writer_or_libvirt(local):
    loaded = _imports_of("launcher", "domain", "--accel", "tcg", "--cache-dir", local["cache"], local["vmi"])
    assert "launcher.render.domain" in loaded
    assert sorted(loaded.intersection(("pycdlib", "libvirt"))) == []


# A pod's exec probes run `launcher status` every few seconds: finding a VM and asking libvirt about
# it needs neither the machinery that starts one nor the registry's client (0.45 CPU-s a probe with
# them, 0.15 without); `ls` lists exports too, which the registry's client resolves.
RUN_ONLY = ("launcher.runtime.vms", "launcher.diskserver.client", "launcher.node.pull", "launcher.network.linuxbridge",
            *(name for name in VMI_ONLY if name != "libvirt"))  # a lookup asks libvirt


@pytest.mark.parametrize("argv, code, unloaded", [(("status", "--cache-dir", "{cache}", "nosuchvm"), 5, RUN_ONLY + HTTP),
                                                  (("ls", "--cache-dir", "{cache}"), 0, RUN_ONLY)], ids=["status", "ls"])
def test_launcher_lookups_load_no_run_machinery(local, argv, code, unloaded):
    loaded = _imports_of("launcher", *(str(a).format(**local) for a in argv), code=code)
    assert "launcher.runtime.lookup" in loaded
    assert sorted(loaded.intersection(unloaded)) == []
