"""Host keys and the login user without a VM: what cloud-init prints on the console
(cloudinit/config/cc_keys_to_console.py and tools/write-ssh-key-fingerprints: the keys between
-----BEGIN SSH HOST KEY KEYS----- and -----END SSH HOST KEY KEYS-----; cc_ssh_authkey_fingerprints.py:
`Authorized keys from PATH for user NAME` and a row per key with its sha256 fingerprint; cmd/main.py:
`Cloud-init v. X running '<stage>'` / `finished at`), read from a real first boot of images/cloudguest
(tests/golden/console/), the known_hosts written from it, the ssh options, and the image label
`launcher test` reads its user from."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from diskkit.oci.userhint import DEFAULT_USER_LABEL, default_user
from launcher.cli.smoketest import login_user, no_login
from launcher.cli.ssh import parse_target, ssh_command
from launcher.runtime.cloudinitreport import BEGIN_KEYS, END_KEYS, KEYS_MAX, LINE_MAX, HostKey, Report, fingerprint, parse_key
from launcher.runtime.sshreach import SILENT_MAX, Contact, known, known_hosts_text, record_keys, silent_limit, ssh_quote
from tests.conftest import run_diskkit, run_launcher
from tests.testguest import ensure_testguest

FIRST_BOOT = (Path(__file__).parent / "golden" / "console" / "cloudguest-first-boot.txt").read_bytes()
# The accessCredential's key that boot was given; cloud-init installed it for its default user.
BOOT_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICEep3WGKtz62kXxX+ye5zUhmikiJlm3CZUY7SFSITC2 root@vm"
ED25519 = "AAAAC3NzaC1lZDI1NTE5AAAAIJ+EPDv5yszyJGDWXdvPpOiDBNO9hEVqeDJH0pEdPAW7"
ECDSA = ("AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBD5C575OZE6ecjRBlKakljnHk9PXC4lOy9ZVG4ecjZZ3OP97YNvrkGdVS6J"
         "KESnbBzOBimPNFQzWF2s7sywdnlA=")


def fed(*chunks: bytes) -> Report:
    report = Report()
    for chunk in chunks:
        report.feed(chunk)
    return report


def blob(type_: str, body: bytes = b"\0\0\0\x20" + b"k" * 32) -> str:
    return base64.b64encode(struct.pack(">I", len(type_)) + type_.encode() + body).decode()


def test_a_first_boot_gives_its_host_keys_and_the_default_user():
    report = fed(FIRST_BOOT)
    assert report.host_keys == (HostKey("ecdsa-sha2-nistp256", ECDSA), HostKey("ssh-ed25519", ED25519))
    assert report.cloud_init and report.finished and report.verdict() == "keys"
    assert report.user_of(BOOT_KEY) == "debian"
    assert report.user_of(f"ssh-ed25519 {ED25519}") is None  # a key cloud-init did not install


def test_the_console_read_in_pieces_gives_the_same():
    pieces = [FIRST_BOOT[i:i + 7] for i in range(0, len(FIRST_BOOT), 7)]
    assert fed(*pieces).host_keys == fed(FIRST_BOOT).host_keys


def test_the_verdict_as_the_boot_goes():
    head, _, _ = FIRST_BOOT.partition(b"running 'init-local'")
    assert fed(head).verdict() == "first-use"  # no cloud-init (yet): sshreach asks only once sshd answers
    before_keys = FIRST_BOOT[:FIRST_BOOT.index(BEGIN_KEYS.encode())]
    assert fed(before_keys).verdict() == "wait"  # cloud-init runs and will print them
    finished_without = b"Cloud-init v. 22.4.2 running 'init' at x\nCloud-init v. 22.4.2 finished at y\n"
    assert fed(finished_without).verdict() == "first-use"


def test_only_the_first_block_counts():
    other = blob("ssh-ed25519")
    later = f"{BEGIN_KEYS}\nssh-ed25519 {other} evil@guest\n{END_KEYS}\n".encode()
    assert fed(FIRST_BOOT, later).host_keys == fed(FIRST_BOOT).host_keys


def test_an_unfinished_block_gives_nothing():
    report = fed(f"Cloud-init v. 1 running 'x'\n{BEGIN_KEYS}\nssh-ed25519 {ED25519} root@g\n".encode())
    assert report.host_keys is None and report.verdict() == "wait"


@pytest.mark.parametrize("line", [
    f"ssh-rsa {blob('ssh-ed25519')} a key that names another type",
    "ssh-ed25519 AAAA!!!! not base64",
    f"ssh-ed25519 {base64.b64encode(struct.pack('>I', 11) + b'ssh-ed25519').decode()} no key after the type",
    "@cert-authority * just words",
])
def test_malformed_keys_are_not_learned(line):
    report = fed(f"{BEGIN_KEYS}\n{line}\nssh-ed25519 {ED25519} root@g\n{END_KEYS}\n".encode())
    assert report.host_keys == (HostKey("ssh-ed25519", ED25519),)


def test_known_hosts_lines_carry_only_our_alias_and_the_checked_key():
    # A marker or host pattern the guest puts before a key is not carried into the file.
    report = fed(f"{BEGIN_KEYS}\n@cert-authority *.example ssh-ed25519 {ED25519} x\n{END_KEYS}\n".encode())
    assert known_hosts_text("vmi.a.default", report.host_keys) == f"vmi.a.default ssh-ed25519 {ED25519}\n"


def test_a_guest_printing_without_end_is_bounded():
    keys = "".join(f"ssh-ed25519 {blob('ssh-ed25519', bytes([0, 0, 0, 32]) + bytes([i]) * 32)}\n" for i in range(KEYS_MAX + 5))
    report = fed(f"{BEGIN_KEYS}\n{keys}{END_KEYS}\n".encode())
    assert len(report.host_keys) == KEYS_MAX
    report = fed(b"x" * (4 * LINE_MAX), b"y" * (4 * LINE_MAX))
    assert len(report._partial) <= LINE_MAX


def test_fingerprint_as_cloud_init_prints_it():
    # cc_ssh_authkey_fingerprints._gen_fingerprint: sha256 of the key blob, colon-separated hex
    assert fingerprint(BOOT_KEY).encode() in FIRST_BOOT
    assert fingerprint("not a key") is None and fingerprint("ssh-ed25519 !!") is None
    assert parse_key("ssh-ed25519", ED25519) == HostKey("ssh-ed25519", ED25519)


def test_known_hosts_is_never_rewritten(tmp_path):
    first = record_keys(tmp_path, "vmi.a.default", (HostKey("ssh-ed25519", ED25519),))
    again = record_keys(tmp_path, "vmi.a.default", (HostKey("ecdsa-sha2-nistp256", ECDSA),))
    assert first == again == known(tmp_path, "vmi.a.default")
    assert (tmp_path / "known_hosts").read_text() == f"vmi.a.default ssh-ed25519 {ED25519}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["known_hosts"]  # no temporary file left
    assert known(tmp_path / "nothing", "x") is None


def test_ssh_takes_the_users_options_first_and_the_vms_keys_under_one_alias():
    contact = Contact(Path("/c 1/run/default_web/known_hosts"), "vmi.web.prod", False)
    argv = ssh_command(parse_target("jdoe@vm/web/prod"), 22, ["l"], identity="/k/id", local_opts=("-o UserKnownHostsFile=/dev/null",),
                       host_key_opts=contact.ssh_options(), command=("true",))
    assert argv[3:] == ["-o", "UserKnownHostsFile=/dev/null",  # the user's: ssh keeps an option's first value
                        "-o", 'UserKnownHostsFile="/c 1/run/default_web/known_hosts"', "-o", "GlobalKnownHostsFile=/dev/null",
                        "-o", "HostKeyAlias=vmi.web.prod", "-o", "StrictHostKeyChecking=yes",
                        "-i", "/k/id", "jdoe@vm.web.prod", "true"]
    assert Contact(Path("/k"), "a", True).ssh_options()[-1] == "StrictHostKeyChecking=accept-new"


def test_ssh_quote_survives_ssh_s_own_splitting(tmp_path):
    odd = tmp_path / 'a b"c%d\\e' / "known_hosts"
    odd.parent.mkdir()
    odd.write_text(f"vmi.a.default ssh-ed25519 {ED25519}\n")
    # ssh -G prints the configuration it would use: the path comes back whole.
    shown = subprocess.run(["ssh", "-G", "-F", "/dev/null", "-o", f"UserKnownHostsFile={ssh_quote(odd)}", "x"],
                           capture_output=True, text=True, check=True).stdout
    assert f"userknownhostsfile {odd}" in shown.splitlines() or f'userknownhostsfile "{odd}"' in shown.splitlines(), shown


@pytest.mark.parametrize("labels, user", [
    ({DEFAULT_USER_LABEL: "debian"}, "debian"),
    ({"other": "x"}, None),
    (None, None),
])
def test_the_default_user_label(labels, user):
    assert default_user({"config": {"Labels": labels}}, "img") == user


@pytest.mark.parametrize("value", ["-oProxyCommand=touch /tmp/x", "a b", "", "x" * 33, "root@host", 5])
def test_a_label_that_is_not_a_user_name_is_refused(value):
    with pytest.raises(DiskkitError) as err:
        default_user({"config": {"Labels": {DEFAULT_USER_LABEL: value}}}, "reg/img:v1")
    assert str(err.value).startswith(f"reg/img:v1: label {DEFAULT_USER_LABEL}: must be a user name")


def test_who_launcher_test_logs_in_as():
    booted = fed(FIRST_BOOT)
    assert login_user("alice", "bob", booted, BOOT_KEY) == ("alice", None)
    assert login_user(None, "bob", booted, BOOT_KEY) == ("bob", f"the image's label {DEFAULT_USER_LABEL}")
    assert login_user(None, None, booted, BOOT_KEY) == ("debian", "cloud-init's default user, whom it gave the key")
    assert login_user(None, None, Report(), BOOT_KEY)[0] == "root"


def test_a_failed_login_as_a_guessed_root_names_how_to_give_the_user():
    # `launcher test` took root because the image named no user: its failure says how to name one.
    last = "root@127.0.0.1: Permission denied (publickey)."
    guessed = no_login(*login_user(None, None, Report(), BOOT_KEY), last)
    assert guessed == (f"no ssh login as root within --timeout (last try: {last}); give the image's user with --user, "
                       f"or as its label {DEFAULT_USER_LABEL} (diskkit build --label {DEFAULT_USER_LABEL}=USER)")
    # A user someone named (--user, the label, cloud-init) was no guess: nothing to add.
    for named in (login_user("root", None, Report(), BOOT_KEY), login_user(None, "bob", Report(), BOOT_KEY),
                  login_user(None, None, fed(FIRST_BOOT), BOOT_KEY)):
        assert no_login(*named, last) == f"no ssh login as {named[0]} within --timeout (last try: {last})"


def test_launcher_test_refuses_a_label_that_is_not_a_user_name_before_booting(tmp_path):
    layout = f"oci:{tmp_path / 'layout'}:v1"
    built = run_diskkit("build", ensure_testguest() / "testguest-poweroff.qcow2", "-t", layout, "--label", f"{DEFAULT_USER_LABEL}=-oProxyCommand=sh")
    assert built.code == 0, built.err
    result = run_launcher("test", "--json", "--cache-dir", tmp_path / "cache", layout)
    assert result.code == 3, result.err
    out = json.loads(result.out)
    assert out["result"] == "fail" and out["reason"] == f"{layout}: label {DEFAULT_USER_LABEL}: must be a user name " \
        "(a letter or _, then letters, digits, _ . -; at most 32)", out


def test_a_probe_made_while_the_guest_boots_is_given_up_soon_and_later_ones_wait_longer():
    # A connection made before the guest's network is up is never answered (passt sends the guest one
    # SYN and waits 10 s for it): the first probe gives up after 2 s (a VM already up answers its first
    # in about one), later ones wait twice as long each time, so an ssh server slow to send its
    # identification line (OpenSSH re-executing itself under TCG) is still heard, up to SILENT_MAX.
    assert [silent_limit(n) for n in range(6)] == [2.0, 4.0, 8.0, SILENT_MAX, SILENT_MAX, SILENT_MAX]
    assert silent_limit(10_000) == SILENT_MAX
