"""`launcher ssh` and `launcher test` without a VM: virtctl's target syntax and ssh command line
(pkg/virtctl/ssh/ssh.go ParseTarget, LocalClientCmd, BuildProxyCommandOption;
pkg/virtctl/portforward/portforward.go ParseTarget), and the VMI `launcher test` boots."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from diskkit.errors import DiskkitError
from launcher.cli.smoketest import KEY_SECRET, generated_vmi, key_secret, with_key
from launcher.cli.ssh import Target, parse_target, proxy_command, ssh_command
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
from launcher.volumes import gendisks


@pytest.mark.parametrize("arg, target", [
    ("vmi/testvmi", Target("vmi", "testvmi")),
    ("jdoe@vm/testvm/mynamespace", Target("vm", "testvm", "mynamespace", "jdoe")),
    ("VirtualMachineInstances/a", Target("vmi", "a")),
    ("bare", Target("vmi", "bare")),  # as `launcher port-forward` takes it
    ("root@bare", Target("vmi", "bare", None, "root")),
])
def test_targets(arg, target):
    assert parse_target(arg) == target


@pytest.mark.parametrize("arg, message", [
    ("@vmi/a", "expected username before '@'"),
    ("root@", "expected target after '@'"),
    ("", "target cannot be empty"),
    ("vmi/a/b/c", "target is not valid with more than two '/'"),
    ("pod/a", "unsupported resource type 'pod'"),
    ("vmi/a/", "namespace cannot be empty"),
    ("vmi/", "name cannot be empty"),
])
def test_target_refusals_in_virtctls_words(arg, message):
    with pytest.raises(DiskkitError) as err:
        parse_target(arg)
    assert str(err.value) == f"target: {message}"


def test_ssh_command_line_in_virtctls_order():
    target = parse_target("jdoe@vmi/web/prod")
    argv = ssh_command(target, 2222, ["/usr/bin/python3", "-m", "launcher"], identity="/k/id", user="ignored",
                       local_opts=("-o StrictHostKeyChecking=no",), command=("uname", "-a"), cache_dir="/c 1")
    assert argv == ["ssh", "-o", "ProxyCommand=/usr/bin/python3 -m launcher port-forward --stdio vmi/web/prod 2222 --cache-dir '/c 1'",
                    "-o", "StrictHostKeyChecking=no", "-i", "/k/id", "jdoe@vmi.web.prod", "uname", "-a"]
    # -l (or $USER) when the target has no user; no -i: ssh's own keys
    assert ssh_command(parse_target("vmi/web"), 22, ["l"], user="root")[-1] == "root@vmi.web.default"
    assert ssh_command(parse_target("vmi/web"), 22, ["l"])[-1] == "vmi.web.default"


def test_proxy_command_survives_ssh_token_expansion_and_the_shell(tmp_path):
    # ssh expands %-tokens, then runs the command with the user's shell: a path with both comes through.
    odd = tmp_path / "100% $(not run)"
    command = proxy_command(Target("vmi", "a"), 22, [sys.executable, "-m", "launcher"], str(odd))
    assert "100%% " in command
    assert shlex.split(command.replace("%%", "%"))[-1] == str(odd)


def test_the_launcher_runs_from_any_directory(tmp_path):
    # the ProxyCommand's launcher is this interpreter's module, not a script found through PATH or the cwd
    out = subprocess.run([sys.executable, "-m", "launcher", "--version"], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and out.stdout.startswith("launcher"), out.stderr


def test_launcher_test_vmi_carries_the_key_as_an_access_credential(tmp_path):
    doc = with_key(generated_vmi("launcher-test-1", "registry.local/img:1", "1Gi"))
    vmi = parse_vmi(doc)
    assert [(c.secret_name, c.method) for c in vmi.access_credentials] == [(KEY_SECRET, "noCloud")]
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(Objects([key_secret("default", "ssh-ed25519 AAAt t")]), tmp_path))
    files = gen.cloud_init(vmi.volume("cloudinitdisk"), "at").files
    assert b'"public-keys":{"0":"ssh-ed25519 AAAt t"}' in files["meta-data"]
    assert files["user-data"] == b"#cloud-config\ndisable_root: false\n"


def test_a_vmi_file_gets_a_nocloud_disk_only_when_it_has_none():
    own = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm"},
           "spec": {"template": {"spec": {"domain": {"devices": {}}, "volumes": [
               {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\nuser: fedora\n"}}]}}}}
    spec = with_key(own)["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["ci"] and len(spec["accessCredentials"]) == 1
    assert "accessCredentials" not in own["spec"]["template"]["spec"]  # the caller's document is not changed
