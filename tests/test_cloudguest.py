"""The real cloud guest (images/cloudguest) booted once for the module through the launcher as the
qemu user, as a KubeVirt user boots a cloud image: a containerDisk, a NoCloud disk and an ssh key from
accessCredentials (pkg/cloud-init/cloud-init.go puts it in the NoCloud meta-data's public-keys, which
cloud-init installs for its default user). Each check is its own test id, reading the one boot.

Host keys: cloud-init prints the keys it made at first boot on the console
(cloudinit/config/cc_keys_to_console.py, between -----BEGIN SSH HOST KEY KEYS----- and -----END ...),
and `launcher ssh` trusts those, with no ssh options, and refuses a changed one.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from launcher.cli.smoketest import login_user
from launcher.runtime.cloudinitreport import Report
from tests.cloudguest import CloudGuest, cloud_guest  # noqa: F401  (fixture)

pytestmark = pytest.mark.vm


def console_report(guest: CloudGuest) -> Report:
    report = Report()
    report.feed(guest.console().encode())
    return report


def test_the_cloud_guest_boots_to_a_login_prompt(cloud_guest: CloudGuest):
    assert cloud_guest.started.code == 0, cloud_guest.started.err
    console = cloud_guest.console()
    assert "Debian GNU/Linux 12" in console and "login:" in console, console[-3000:]


def test_cloud_init_finishes_from_the_nocloud_disk(cloud_guest: CloudGuest):
    assert cloud_guest.reported().get("cloud-init") == "status: done", cloud_guest.first_ssh
    assert "Datasource DataSourceNoCloud" in cloud_guest.console()


def test_ssh_straight_after_wait_for_needs_no_options(cloud_guest: CloudGuest):
    first = cloud_guest.first_ssh
    assert first.code == 0, first.err
    assert cloud_guest.reported()["user"] == cloud_guest.default_user == "debian"
    # The keys came from the console, not from trusting the first key shown.
    assert "trusting the key" not in first.err, first.err
    learned = (cloud_guest.run_dir / "known_hosts").read_text()
    assert f"vmi.cloudguest.default {cloud_guest.reported()['ed25519']}\n" in learned
    assert learned.splitlines() == [f"vmi.cloudguest.default {k.type} {k.key}" for k in console_report(cloud_guest).host_keys]


def test_the_default_user_has_passwordless_sudo(cloud_guest: CloudGuest):
    assert cloud_guest.reported()["sudo"] == "root", cloud_guest.first_ssh


def test_the_guest_agent_is_installed(cloud_guest: CloudGuest):
    assert cloud_guest.reported()["agent"] == "install ok installed", cloud_guest.first_ssh


def test_a_changed_host_key_is_refused(cloud_guest: CloudGuest, tmp_path):
    known_hosts = cloud_guest.run_dir / "known_hosts"
    learned = known_hosts.read_text()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    other = (tmp_path / "other.pub").read_text().split()[1]
    # Every key the guest has, replaced by another of its type: a man in the middle's.
    tampered = "".join(f"{host} {kind} {other if kind == 'ssh-ed25519' else key}\n"
                       for host, kind, key in (line.split() for line in learned.splitlines()) if kind == "ssh-ed25519")
    try:
        known_hosts.write_text(tampered)
        refused = cloud_guest.ssh("true")
        assert refused.code == 255, refused
        assert "Host key verification failed" in refused.err, refused.err
    finally:
        known_hosts.write_text(learned)
    assert cloud_guest.ssh("true").code == 0  # the guest's own keys still do


def test_launcher_test_finds_the_default_user_cloud_init_names(cloud_guest: CloudGuest):
    # What `launcher test` does without --user or a label: the user cloud-init installed the test's key for.
    user, source = login_user(None, None, console_report(cloud_guest), cloud_guest.public_key)
    assert (user, source) == ("debian", "cloud-init's default user, whom it gave the key")
    assert login_user(None, None, Report(), cloud_guest.public_key)[0] == "root"


def test_port_forward_gives_the_ssh_options_that_check_the_vms_keys(cloud_guest: CloudGuest):
    forward = cloud_guest.user.popen("port-forward", "vmi/cloudguest", "0:22")
    try:
        port = re.fullmatch(r"Forwarding from 127\.0\.0\.1:(\d+) -> 22 \(tcp\)\n", forward.stdout.readline()).group(1)
        hint = forward.stderr.readline()
        prefix = "launcher: ssh with cloudguest's host keys: ssh "
        assert hint.startswith(prefix), hint
        *options, target = shlex.split(hint[len(prefix):])
        assert options[-2:] == ["-p", port] and target == "USER@127.0.0.1", hint
        done = subprocess.run(["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-i", str(cloud_guest.key), *options, "debian@127.0.0.1", "id -un"],
                              capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout) == (0, "debian\n"), done.stderr
    finally:
        forward.terminate()
        forward.wait(timeout=60)
