"""`launcher test`: the boot smoke test kubevirt/containerdisks runs on every image it publishes, on one
machine: boot the image with a fresh ed25519 key, wait for ssh, run a command, stop and clean up.

The key reaches the guest as KubeVirt's accessCredentials put it (noCloud propagation: the NoCloud
meta-data's `public-keys`, which cloud-init installs for the default user), from a Secret the command
makes in memory; `disable_root: false` in the user data lets cloud-init give it to root too. The VM runs
in this process (launcher.runtime.vms.run, on the main thread for its signal handling); a second thread
waits for ssh through `launcher port-forward --stdio` (host keys settled as for `launcher ssh`,
launcher.runtime.sshreach), runs the command and stops the VM. It logs in as `--user`, else as the
image's label names (diskkit.oci.userhint), else as the user cloud-init says on the console it gave the
key to (its default user: debian, fedora...), else as root.
"""

from __future__ import annotations

import copy
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click

from diskkit.cli.shell import platform as platform_of
from diskkit.cli.shell import registry_options
from diskkit.errors import DiskkitError, Exit, TimedOut
from diskkit.oci.userhint import DEFAULT_USER_LABEL, default_user
from diskkit.progress import NoteReporter
from diskkit.registry.options import RegistryOptions
from launcher.cli.imagesource import accel_option, pull_policy_option
from launcher.cli.options import cache_option, node_cache, say, storage_options, trust_options
from launcher.cli.ssh import Target, ssh_command
from launcher.node.selfexec import launcher_argv
from launcher.runtime.cloudinitreport import Report
from launcher.runtime.consolewatch import Matcher, Watch, compile_patterns
from launcher.volumes.guestplatform import check_config, check_requested
from launcher.spec.k8s import Objects
from launcher.volumes.storage import Storage

# Exit statuses, distinct so CI can tell a broken image from a broken command.
PASSED, COMMAND_FAILED, NOT_BOOTED, NO_SSH = Exit.OK, Exit.FAILED, Exit.GUEST_FAILED, Exit.TIMEOUT  # diskkit.errors.Exit, the table of both CLIs
KEY_SECRET = "launcher-test-ssh-key"
USER_DATA = "#cloud-config\ndisable_root: false\n"
# ssh as a probe: no questions, no user configuration in the way; the VM's host keys are settled by
# launcher.runtime.sshreach as for `launcher ssh`.
SSH_OPTS = ("-F /dev/null", "-o BatchMode=yes", "-o IdentitiesOnly=yes", "-o LogLevel=ERROR", "-o ConnectTimeout=20")


@dataclass
class Result:
    vmi: str
    images: dict = field(default_factory=dict)  # containerDisk image -> manifest digest
    command: str = ""
    exit_status: int | None = None  # the command's, None when it never ran
    boot_to_ssh_seconds: float | None = None  # from the domain's start to the first ssh login
    expect: dict = field(default_factory=dict)  # --expect pattern -> the first console line it matched, or None
    fail_on: dict = field(default_factory=dict)  # --fail-on pattern -> the console line it matched, or None
    passed: bool = False
    reason: str = ""
    stdout: str = ""
    stderr: str = ""
    attestations: list = field(default_factory=list)  # what --attest-* pushed, one per image
    traces: list = field(default_factory=list)  # what --record-trace pushed, one per lazily served image
    accel: dict | None = None  # the accelerator the VM ran on, and why (launcher.runtime.accel)

    def to_json(self) -> dict:
        out = asdict(self)
        return {"vmi": out["vmi"], "images": out["images"], "command": out["command"], "exitStatus": out["exit_status"],
                "bootToSshSeconds": out["boot_to_ssh_seconds"],
                "expect": out["expect"], "failOn": out["fail_on"], "result": "pass" if self.passed else "fail",
                "reason": out["reason"], "stdout": out["stdout"], "stderr": out["stderr"],
                **({"attestations": out["attestations"]} if self.attestations else {}),
                **({"traces": out["traces"]} if self.traces else {}), "accel": out["accel"]}


# ---------------------------------------------------------------- the VMI (pure)

def generated_vmi(name: str, image: str, memory: str) -> dict:
    """A containerDisk VMI with a NoCloud disk, both virtio as kubevirt/containerdisks' test VMs have
    them, and no interfaces: KubeVirt's default pod interface."""
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
            "spec": {"domain": {"resources": {"requests": {"memory": memory}},
                                "devices": {"disks": [{"name": "containerdisk", "disk": {"bus": "virtio"}},
                                                      {"name": "cloudinitdisk", "disk": {"bus": "virtio"}}]}},
                     "volumes": [{"name": "containerdisk", "containerDisk": {"image": image}},
                                 {"name": "cloudinitdisk", "cloudInitNoCloud": {"userData": USER_DATA}}]}}


def with_key(doc: dict) -> dict:
    """`doc` (a VMI or VM) with an accessCredential for the test key, and a NoCloud disk if it has none."""
    doc = copy.deepcopy(doc)
    spec = doc.setdefault("spec", {})
    if doc.get("kind") == "VirtualMachine":
        spec = spec.setdefault("template", {}).setdefault("spec", {})
    volumes = spec.setdefault("volumes", [])
    if not any(isinstance(v, dict) and "cloudInitNoCloud" in v for v in volumes):
        volumes.append({"name": "launcher-test-cloudinit", "cloudInitNoCloud": {"userData": USER_DATA}})
        # KubeVirt's VMI defaults give a disk to each volume without one (SetDefaultVolumeDisk, run by
        # virt-api's mutating webhook); the launcher renders only declared disks, so the disk is declared here.
        devices = spec.setdefault("domain", {}).setdefault("devices", {})
        devices.setdefault("disks", []).append({"name": "launcher-test-cloudinit", "disk": {"bus": "virtio"}})
    spec.setdefault("accessCredentials", []).append(
        {"sshPublicKey": {"source": {"secret": {"secretName": KEY_SECRET}}, "propagationMethod": {"noCloud": {}}}})
    return doc


def key_secret(namespace: str, public_key: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": KEY_SECRET, "namespace": namespace},
            "stringData": {"key": public_key}}


# ---------------------------------------------------------------- the shell

NO_USER_NAMED = f"neither a label {DEFAULT_USER_LABEL} nor cloud-init's console names the image's user"


def login_user(given: str | None, labelled: str | None, report: Report, public_key: str) -> tuple[str, str | None]:
    """Who the test logs in as, and where the image said it (None: given with --user): the image's label,
    else the user cloud-init installed the test's key for (its table on the console: its default user
    for the accessCredential's key), else root."""
    if given:
        return given, None
    if labelled:
        return labelled, f"the image's label {DEFAULT_USER_LABEL}"
    if user := report.user_of(public_key):
        return user, "cloud-init's default user, whom it gave the key"
    return "root", NO_USER_NAMED


def no_login(user: str, source: str | None, last: str) -> str:
    """Why the test failed when ssh never let it in; root taken for want of a named user is a guess, so
    the reason says how to name the image's user."""
    reason = f"no ssh login as {user} within --timeout (last try: {last})"
    if source == NO_USER_NAMED:
        reason += f"; give the image's user with --user, or as its label {DEFAULT_USER_LABEL} (diskkit build --label {DEFAULT_USER_LABEL}=USER)"
    return reason


class _Reach(threading.Thread):
    """Wait for the VM's record, then for ssh; run the command; stop the VM whatever happened."""

    def __init__(self, cache, cache_dir, target: Target, port: int, key: Path, public_key: str, command: tuple[str, ...], deadline: float,
                 result: Result, capture: bool, matcher: Matcher, labelled_user: str | None, trace: str | None = None):
        super().__init__(daemon=True)
        self.trace = trace  # --record-trace's token: the boot's reads are taken before the VM stops
        self.traces: list[dict] = []
        self.trace_error: DiskkitError | None = None
        self.cache, self.target, self.port, self.deadline, self.result, self.capture = cache, target, port, deadline, result, capture
        self.matcher = matcher
        self.console_changed = threading.Event()  # set by the console watch when it read new lines
        self.vm_gone = threading.Event()  # set when vms.run returned or raised
        self.public_key, self.labelled_user, self.command = public_key, labelled_user, command
        self.common = dict(identity=str(key), local_opts=SSH_OPTS, cache_dir=cache_dir)
        self.outcome: int | None = None

    def run(self) -> None:
        from launcher.runtime.lookup import find_record
        from launcher.runtime.vms import stop

        try:
            self.outcome = self._reach(find_record)
            if self.outcome == PASSED and self.trace is not None and not self.vm_gone.is_set():
                from launcher.runtime.tracepublish import take

                try:
                    self.traces = take(self.cache, self.trace)
                except (DiskkitError, OSError, ValueError) as err:
                    self.trace_error = err if isinstance(err, DiskkitError) else DiskkitError("the node's disk server", str(err))
        finally:
            if not self.vm_gone.is_set():
                try:
                    stop(self.cache, self.target.vm)
                except DiskkitError:
                    pass  # it went by itself meanwhile

    def _reach(self, find_record) -> int:
        from launcher.runtime.sshreach import first_contact

        while find_record(self.cache, self.target.vm) is None:
            if self.vm_gone.wait(0.2):
                return NOT_BOOTED
            if time.monotonic() > self.deadline:
                self.result.reason = "the VM did not start within --timeout"
                return NO_SSH
        started = time.monotonic()
        try:
            contact = first_contact(self.cache, self.target.vm, self.port, max(self.deadline - started, 0.001), say, stop=self.vm_gone)
        except TimedOut:
            self.result.reason = f"no ssh login within --timeout (its ssh server on guest port {self.port} never answered)"
            return NO_SSH
        except DiskkitError as err:
            self.result.reason = "the VM stopped before ssh answered" if self.vm_gone.is_set() else str(err)
            return NOT_BOOTED
        user, source = login_user(self.target.user, self.labelled_user, contact.report, self.public_key)
        if source:
            say(f"{self.target.forward}: logging in as {user}: {source}")
        target = replace(self.target, user=user)
        common = dict(self.common, host_key_opts=contact.ssh_options())
        probe_command = ssh_command(target, self.port, launcher_argv(), command=("true",), **common)
        while True:
            probe = subprocess.run(probe_command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if self.vm_gone.is_set():
                self.result.reason = "the VM stopped before ssh answered"
                return NOT_BOOTED
            if time.monotonic() > self.deadline:
                self.result.reason = no_login(user, source, (probe.stderr.strip().splitlines() or ["no answer"])[-1])
                return NO_SSH
            self.vm_gone.wait(1)
        self.result.boot_to_ssh_seconds = round(time.monotonic() - started, 1)
        if not self.capture:
            say(f"{self.target.forward}: ssh answered {self.result.boot_to_ssh_seconds:.1f} s after the VM started")
        run_it = ssh_command(target, self.port, launcher_argv(), command=self.command, **common)
        done = subprocess.run(run_it, stdin=subprocess.DEVNULL, capture_output=self.capture, text=True)
        self.result.exit_status = done.returncode
        if self.capture:
            self.result.stdout, self.result.stderr = done.stdout, done.stderr
        if done.returncode != 0:
            self.result.reason = f"the command exited with {done.returncode}"
            return COMMAND_FAILED
        # The command passed; what --expect waits for may still be on its way to the console.
        while self.matcher.missing and self.matcher.failed is None:
            if self.vm_gone.is_set():
                self.result.reason = f"the VM stopped before --expect {self.matcher.missing[0]!r} appeared on the console"
                return NOT_BOOTED
            if time.monotonic() > self.deadline:
                self.result.reason = f"--expect {self.matcher.missing[0]!r} did not appear on the console within --timeout"
                return NO_SSH
            self.console_changed.wait(0.5)
            self.console_changed.clear()
        if self.matcher.failed is not None:
            return NOT_BOOTED
        self.result.passed = True
        return PASSED

    def stop_now(self) -> None:
        """A --fail-on line: stop the VM at once (once it has a record to stop it by)."""
        from launcher.runtime.lookup import find_record
        from launcher.runtime.vms import stop

        while not self.vm_gone.is_set():
            if find_record(self.cache, self.target.vm) is not None:
                try:
                    stop(self.cache, self.target.vm)
                except DiskkitError:
                    pass  # it went by itself meanwhile
                return
            self.vm_gone.wait(0.2)


def _attester(sign_by: str | None, private_key: Path | None, passphrase_file: Path | None):
    """The attestation key, opened before anything boots (a wrong passphrase costs no boot)."""
    if sign_by and private_key:
        raise click.UsageError("give one of --attest-sign-by and --attest-sigstore-private-key")
    if passphrase_file and not (sign_by or private_key):
        raise click.UsageError("--attest-passphrase-file needs --attest-sign-by or --attest-sigstore-private-key")
    if not (sign_by or private_key):
        return None
    from diskkit.ops.attest import Attester
    from diskkit.signing.options import SignOptions

    return Attester(SignOptions(private_key, passphrase_file, sign_by=sign_by))


def _attest(attester, result: Result, registry: RegistryOptions) -> None:
    """One signed statement per containerDisk image the test booted."""
    from diskkit import __version__
    from diskkit.signing.attestation import boot_test_predicate

    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for image, digest in result.images.items():
        predicate = boot_test_predicate(image, digest, result.command, result.boot_to_ssh_seconds, result.passed,
                                        result.exit_status, result.reason, f"launcher {__version__}", stamp)
        pushed = attester.attach(image, digest, predicate, registry)
        result.attestations.append(pushed)
        say(f"attested {image}@{digest[:19]}: {pushed['referrer']} ({pushed['listedBy']})")


def _resolved(cache, image: str, plat, registry: RegistryOptions) -> tuple[str, dict]:
    """(manifest digest, config) of the image a lazy boot will read, admitted by the policy in force
    as a pull is, and refused on its config when foreign."""
    from launcher.node.admission import admitted

    with admitted(image, registry, plat, cache) as source:
        got = source.image(plat)
    check_config(image)(got.config)
    return got.digest, got.config


def _load(path: str) -> dict:
    """A VMI or VM file's one document, within the API server's limits."""
    from launcher.spec.meta import load_documents

    docs = [d for d in load_documents(path) if d is not None]
    if len(docs) != 1:
        raise DiskkitError(path, f"must hold one VirtualMachineInstance or VirtualMachine document, not {len(docs)}")
    return docs[0]


@click.command("test", epilog="""\b
Examples:
  launcher test quay.io/containerdisks/fedora:40 --user fedora
  launcher test registry.local/debian:12 --attest-sigstore-private-key ci.private --attest-passphrase-file pass
  launcher test registry.local/debian:12 --attest-sign-by 3F1A...C0DE   # GPG, gpg-agent asks
  launcher test registry.local/debian:12 -- systemctl is-system-running --wait   # as cloud-init's default user
  launcher test --json --timeout 600 oci:./layout:v1 > result.json
  launcher test vmi.yaml -- cat /etc/os-release     # a VMI file: the key is added to it
  launcher test vmi.yaml --manifests ./k8s --pvc data=/srv/data   # its claims and Secrets, as launcher run takes them
  launcher test IMAGE --expect 'Reached target.*Multi-User' --fail-on 'Kernel panic' --fail-on 'Call Trace'
\b
Exit status: 0 the command succeeded and every --expect line appeared; 1 the command
failed; 3 the VM did not boot (refused, pull failed, it stopped before ssh answered or
before an --expect line, or a console line matched --fail-on: stopped at once);
4 no ssh login, or an --expect line missing, within --timeout. With --attest-*,
a test that ran (passed or failed) is attached to each containerDisk image as a signed in-toto
statement (an OCI 1.1 referrer; `diskkit verify-attestation` checks it); a failure to attach
exits with that failure's status.
""")
@click.argument("ref")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--user", help=f"Log in as this user (default: the image's label {DEFAULT_USER_LABEL}, else the user cloud-init gave the key, its default user, as its console shows; else root).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300, show_default=True, metavar="SECONDS", help="Give up waiting for ssh after this long (pull and boot included).")
@click.option("--port", type=click.IntRange(1, 65535), default=22, show_default=True, help="The guest's ssh port.")
@click.option("--memory", default="1Gi", show_default=True, help="Guest memory of the generated VMI.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result object (the command's output inside it).")
@click.option("--connect", "uri", metavar="URI", help="libvirt URI (default: qemu:///system as root, else qemu:///session).")
@click.option("--platform", help="OS/ARCH of the image (default: this host's).")
@click.option("--attest-sign-by", metavar="FINGERPRINT", help="Attach the result, signed with this key of your GnuPG keyring ($GNUPGHOME), as an attestation of the image.")
@click.option("--attest-sigstore-private-key", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE", help="Attach the result, signed with this sigstore (cosign-format) key, as an attestation of the image.")
@click.option("--attest-passphrase-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE", help="The attestation key's passphrase (else asked on the terminal, or by gpg-agent).")
@click.option("--record-trace", is_flag=True, help="Boot each containerDisk lazily through the node's disk server, record the order of the boot's reads and, if the test passes, attach it to the image signed with the --attest-* key: disk servers that trust the key prefetch in that order.")
@click.option("--expect", multiple=True, metavar="REGEX", help="A console line that must appear (Python regex, searched in each line) before the test passes. Repeatable.")
@click.option("--fail-on", multiple=True, metavar="REGEX", help="A console line that fails the test at once, e.g. 'Kernel panic' or 'Call Trace'. Repeatable.")
@accel_option
@pull_policy_option
@cache_option
@storage_options
@registry_options
@trust_options
def smoke_test(ref, command, user, timeout, port, memory, as_json, uri, platform, expect, fail_on, accel, pull_policy, attest_sign_by,
               attest_sigstore_private_key, attest_passphrase_file, record_trace, cache_dir, store: Storage, registry: RegistryOptions) -> None:
    """Boot REF (an image, or a VMI file) with a fresh ssh key, run COMMAND over ssh (default: echo hello),
    print the boot-to-ssh time, stop and remove the VM; exit 0 only if the command succeeded."""
    from launcher.node.pull import cached_config, pull
    from launcher.runtime.vms import RunOptions, run
    from launcher.runtime import rundir
    from launcher.runtime.console import ConsoleLog
    from launcher.spec.vmi import parse_vmi

    began = time.monotonic()
    command = command or ("echo", "hello")
    if record_trace and not (attest_sign_by or attest_sigstore_private_key):
        raise click.UsageError("--record-trace publishes a signed trace: give --attest-sign-by or --attest-sigstore-private-key")
    attester = _attester(attest_sign_by, attest_sigstore_private_key, attest_passphrase_file)
    trace = None
    if record_trace:
        from launcher.runtime.tracepublish import new_token

        trace = new_token()
    matcher = Matcher(compile_patterns("--expect", expect), compile_patterns("--fail-on", fail_on))
    if store.objects is not None and not isinstance(store.objects, Objects):
        raise DiskkitError("--kube-api", "launcher test keeps its key Secret in memory: give the objects with --manifests")
    doc = _load(ref) if Path(ref).is_file() else generated_vmi(f"launcher-test-{secrets.token_hex(3)}", ref, memory)
    cache = node_cache(cache_dir)
    keys = Path(tempfile.mkdtemp(prefix="launcher-test-"))  # 0700: the private key never leaves it
    result = Result(vmi="", command=" ".join(command))
    code = NOT_BOOTED
    attach_failed: DiskkitError | None = None
    labelled_user: str | None = None
    interrupted = False
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "launcher-test", "-f", str(keys / "key")],
                       check=True, stdin=subprocess.DEVNULL)
        public = (keys / "key.pub").read_text().strip()
        try:
            vmi = parse_vmi(with_key(doc))
            result.vmi = f"{vmi.namespace}/{vmi.name}"
            plat = platform_of(platform)
            check_requested(plat)
            for volume in vmi.volumes:
                if volume.kind == "containerDisk":
                    src = volume.source
                    if attester is not None:
                        from diskkit.ops.attest import registry_image

                        registry_image(src.image)  # refused before the pull: attestations live in a registry
                    if trace is not None:
                        # Not pulled: the disk server serves it as the VM reads it, and records the reads.
                        digest, config = _resolved(cache, src.image, plat, registry)
                        result.images[src.image] = digest
                        labelled_user = labelled_user or default_user(config, src.image)
                        continue
                    # A foreign image is refused on its config, before its disk is downloaded.
                    pulled = pull(cache, src.image, src.path, plat, registry, pull_policy or src.image_pull_policy,
                                  accept=check_config(src.image), reporter=NoteReporter(lambda text: say(f"note: {text}")))
                    result.images[src.image] = pulled.digest
                    labelled_user = labelled_user or default_user(cached_config(cache, pulled), src.image)
        except DiskkitError as err:
            # Refused before a boot (not found, foreign, unreadable): the refusal's own exit status.
            result.reason = str(err)
            code = err.exit_code if err.exit_code != Exit.FAILED else NOT_BOOTED
            vmi = None
        if vmi is not None:
            target = Target("vmi", vmi.name, vmi.namespace, user)
            reach = _Reach(cache, cache_dir, target, port, keys / "key", public, command, began + timeout, result, as_json, matcher,
                           labelled_user, trace)
            watch = Watch(ConsoleLog(rundir.console_log(cache.run_dir(vmi.domain_name))), matcher, reach.stop_now, reach.console_changed)
            objects = store.objects if store.objects is not None else Objects()
            objects.add(key_secret(vmi.namespace, public), "launcher test's key")
            reach.start()
            watch.start()
            try:
                ran = run(vmi, cache, RunOptions(uri=uri, platform=plat, registry=registry, storage=replace(store, objects=objects), grace_period=0,
                                                 accel=accel, pull_policy=pull_policy, trace=trace,
                                                 **({"lazy": "on"} if trace is not None else {})), say)
                result.accel = ran.accel.to_json()
            except DiskkitError as err:
                if not result.reason:
                    result.reason = str(err)
            finally:
                reach.vm_gone.set()
                reach.join()
                watch.done.set()
                watch.join()
            code = reach.outcome if reach.outcome is not None else NOT_BOOTED
            if matcher.failed is not None:
                code, result.passed = NOT_BOOTED, False
                result.reason = f"a console line matched --fail-on {matcher.failed[0]!r}: {matcher.failed[1]}"
            elif watch.error is not None and not result.reason:
                result.reason = str(watch.error)
            if code == NOT_BOOTED and not result.reason:
                result.reason = "the VM stopped before ssh answered"
            if attester is not None:
                try:
                    _attest(attester, result, registry)
                    if reach.trace_error is not None:
                        raise reach.trace_error
                    if trace is not None and result.passed:
                        from launcher.runtime.tracepublish import publish

                        result.traces = publish(attester, reach.traces, registry, say)
                        for image in sorted(set(result.images) - {t["image"] for t in reach.traces}):
                            say(f"note: no read trace of {image}: it was not served lazily")
                except DiskkitError as err:
                    attach_failed, code = err, err.exit_code  # said last: the test's own line stays true
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the VM is gone; the CLI reports it (--json: its one error object)
        interrupted = True
        raise
    finally:
        shutil.rmtree(keys, ignore_errors=True)
        result.expect = dict(matcher.seen)
        result.fail_on = {p.pattern: (matcher.failed[1] if matcher.failed and matcher.failed[0] == p.pattern else None) for p in matcher.fail_on}
        if interrupted:
            pass
        elif as_json:
            click.echo(json.dumps(result.to_json(), indent=2))
        elif result.passed:
            say(f"PASS {result.vmi or ref}: {result.command!r} succeeded, ssh {result.boot_to_ssh_seconds:.1f} s after boot")
        else:
            say(f"FAIL {result.vmi or ref}: {result.reason}")
        if attach_failed is not None:
            say(f"not attested: {attach_failed}")
    sys.exit(code)
