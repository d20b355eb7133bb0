"""One exit-code table for diskkit and launcher (diskkit.errors.Exit), and with --json every failure
is one JSON object on stdout naming the message, its kind, the registry's HTTP status and error code
and whether a retry may help (issue 32 item 7). Real faults: no registry, a 404 repository and tag,
a 401, a 5xx from a proxy in front of the real registry."""

from __future__ import annotations

import json
import socket
import uuid

from diskkit.errors import EXIT_MEANINGS, Exit
from launcher.cli import smoketest
from tests.conftest import run_diskkit, run_launcher
from tests.faultproxy import Fault

INSECURE = "--tls-verify=false"


def error_of(result) -> dict:
    """The one JSON object a --json failure prints, and its one-line message on stderr."""
    doc = json.loads(result.out)
    assert list(doc) == ["error"], doc
    assert len(result.err.strip().splitlines()) == 1 and doc["error"]["message"] in result.err, result.err
    assert doc["error"]["exitCode"] == result.code
    return doc["error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_table_is_the_one_launcher_test_uses():
    assert (smoketest.PASSED, smoketest.COMMAND_FAILED, smoketest.NOT_BOOTED, smoketest.NO_SSH) == (
        Exit.OK, Exit.FAILED, Exit.GUEST_FAILED, Exit.TIMEOUT) == (0, 1, 3, 4)
    assert len(set(Exit)) == len(Exit.__members__)  # no two names share a status
    assert set(EXIT_MEANINGS) == set(Exit)  # each one documented


def test_no_registry_listening_is_unavailable_and_retryable():
    result = run_diskkit("tags", "--json", INSECURE, "--retry-times", "0", f"127.0.0.1:{free_port()}/nothing/here")
    assert result.code == Exit.UNAVAILABLE == 7
    error = error_of(result)
    assert error["kind"] == "unavailable" and error["retryable"] is True and error["httpStatus"] is None
    assert "cannot connect to the registry" in error["message"]


def test_a_missing_repository_and_a_missing_tag_are_not_found_with_the_registry_code(registry, qcow2, diskkit):
    repo = f"{registry.host}/codes-{uuid.uuid4().hex[:8]}"
    assert diskkit("build", qcow2, "-t", f"{repo}:v1", INSECURE).code == 0
    no_repo = run_diskkit("inspect", "--json", INSECURE, f"{repo}-absent:v1")
    no_tag = run_diskkit("inspect", "--json", INSECURE, f"{repo}:absent")
    assert no_repo.code == no_tag.code == Exit.NOT_FOUND == 5
    repo_error, tag_error = error_of(no_repo), error_of(no_tag)
    assert (repo_error["httpStatus"], repo_error["registryCode"], repo_error["retryable"]) == (404, "NAME_UNKNOWN", False)
    assert (tag_error["httpStatus"], tag_error["registryCode"]) == (404, "MANIFEST_UNKNOWN")
    assert repo_error["kind"] == tag_error["kind"] == "not_found"
    # the commands working on tags answer the same way
    deleted = run_diskkit("delete", "--json", INSECURE, f"{repo}:absent")
    assert deleted.code == Exit.NOT_FOUND and error_of(deleted)["registryCode"] == "MANIFEST_UNKNOWN"
    listed = run_diskkit("tags", "--json", INSECURE, f"{repo}-absent")
    assert listed.code == Exit.NOT_FOUND and error_of(listed)["registryCode"] == "NAME_UNKNOWN"
    gone = run_diskkit("delete", "--json", INSECURE, f"{repo}-absent:v1")
    assert gone.code == Exit.NOT_FOUND and error_of(gone)["registryCode"] == "NAME_UNKNOWN"


def test_missing_from_every_mirror_and_the_registry_is_not_found(registry, tmp_path):
    h = registry.host
    conf = tmp_path / "registries.conf"
    conf.write_text(f'[[registry]]\nprefix = "{h}/alias"\nlocation = "{h}/primary"\ninsecure = true\n'
                    f'[[registry.mirror]]\nlocation = "{h}/mirror-{uuid.uuid4().hex[:8]}"\ninsecure = true\n')
    result = run_diskkit("inspect", "--json", f"{h}/alias/x:v1", env={"CONTAINERS_REGISTRIES_CONF": str(conf), "HOME": str(tmp_path)})
    assert result.code == Exit.NOT_FOUND, result.err
    error = error_of(result)
    assert error["httpStatus"] == 404 and "no pull source has it" in error["message"], error


def test_refused_credentials_are_auth_failures(auth_registry):
    result = run_diskkit("inspect", "--json", INSECURE, f"{auth_registry.host}/private/img:v1",
                         env={"REGISTRY_AUTH_FILE": "/dev/null/none", "HOME": "/nonexistent"})
    assert result.code == Exit.AUTH == 6, result.err
    error = error_of(result)
    assert (error["kind"], error["httpStatus"], error["registryCode"], error["retryable"]) == ("auth", 401, "UNAUTHORIZED", False)


def test_a_registry_answering_5xx_after_every_retry_is_unavailable(registry, fault_proxy, qcow2, diskkit):
    repo = f"codes-{uuid.uuid4().hex[:8]}"
    assert diskkit("build", qcow2, "-t", f"{registry.host}/{repo}:v1", INSECURE).code == 0
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/v1", "status", times=10, arg=503))
    result = run_diskkit("inspect", "--json", INSECURE, "--retry-times", "1", "--retry-delay", "0", f"{proxy.host}/{repo}:v1")
    assert result.code == Exit.UNAVAILABLE, result.err
    error = error_of(result)
    assert (error["httpStatus"], error["retryable"]) == (503, True), error
    assert proxy.pending  # fewer than 10 requests: it gave up after its retries


def test_usage_errors_are_json_too():
    result = run_diskkit("tags", "--json", "--no-such-flag", "localhost/x")
    assert result.code == Exit.USAGE == 2
    assert json.loads(result.out)["error"]["kind"] == "usage"
    twice = run_diskkit("build", "--json", "--path", "/disk/a", "--path", "/disk/b", "-t", "oci:x", "d.qcow2")
    assert twice.code == Exit.USAGE and "given more than once" in error_of(twice)["message"]


def test_launcher_not_found_and_stop_of_a_stopped_vm(tmp_path):
    cache = tmp_path / "cache"
    status = run_launcher("status", "--cache-dir", cache, "nosuchvm")
    assert status.code == Exit.NOT_FOUND, status.err
    # KubeVirt's stop subresource answers "VM is not running" (pkg/virt-api/rest/lifecycle.go); for a
    # script cleaning up, stopping what is already stopped is done, not an error.
    stopped = run_launcher("stop", "--json", "--cache-dir", cache, "nosuchvm")
    assert stopped.code == 0, stopped.err
    assert json.loads(stopped.out) == {"vms": [{"name": "nosuchvm", "stopped": False, "domain": None, "message": "VM nosuchvm is not running",
                                                "how": None, "gracePeriod": None, "seconds": None}]}


# Their stdout is the guest's own stream (a console, a log, an ssh session, a forwarded connection):
# no JSON can wrap it. Their failures still exit with the table's statuses.
STREAMS = {"launcher console", "launcher logs", "launcher ssh", "launcher port-forward", "launcher vnc"}
# What prints KubeVirt's JSON objects whatever is asked (virtctl's guestosinfo, userlist, fslist), and the
# helper `launcher run` starts for a VM (no output of its own).
JSON_ONLY = {"launcher guestosinfo", "launcher userlist", "launcher fslist"}
HELPERS = {"launcher sync-credentials"}


def test_every_command_of_both_clis_takes_json():
    import click

    from diskkit.cli.commands import cli as diskkit_cli
    from launcher.cli.commands import cli as launcher_cli

    def commands(group, prefix):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):  # lazily loaded commands too
            command = group.get_command(ctx, name)
            if isinstance(command, click.Group):
                yield from commands(command, f"{prefix} {name}")
            else:
                yield f"{prefix} {name}", command

    without = {name for group, prog in ((diskkit_cli, "diskkit"), (launcher_cli, "launcher")) for name, command in commands(group, prog)
               if not any("--json" in p.opts for p in command.params if isinstance(p, click.Option))}
    assert without == STREAMS | JSON_ONLY | HELPERS


def test_json_of_the_local_commands(tmp_path, qcow2):
    converted = run_diskkit("convert", "--json", "-O", "raw", qcow2, tmp_path / "d.img")
    assert converted.code == 0, converted.err
    assert json.loads(converted.out) == {"source": str(qcow2), "destination": str(tmp_path / "d.img"), "format": "raw", "inputFormat": "qcow2"}
    (tmp_path / "pass").write_text("secret\n")
    keys = run_diskkit("generate-sigstore-key", "--json", "--output-prefix", tmp_path / "ci", "--passphrase-file", tmp_path / "pass")
    assert keys.code == 0 and json.loads(keys.out) == {"privateKey": f"{tmp_path}/ci.private", "publicKey": f"{tmp_path}/ci.pub"}, keys.err
    again = run_diskkit("generate-sigstore-key", "--json", "--output-prefix", tmp_path / "ci", "--passphrase-file", tmp_path / "pass")
    assert again.code == Exit.FAILED and "refusing to overwrite" in error_of(again)["message"]
    token = run_launcher("dv", "token", "--json", "--cache-dir", tmp_path / "cache", "vms/root")
    assert token.code == 0, token.err
    out = json.loads(token.out)
    assert (out["namespace"], out["name"]) == ("vms", "root") and out["token"]
    missing = run_launcher("status", "--json", "--cache-dir", tmp_path / "cache", "nosuchvm")
    assert missing.code == Exit.NOT_FOUND and error_of(missing)["kind"] == "not_found"


def test_launcher_test_of_a_missing_image_fails_with_its_status(registry, tmp_path):
    """launcher/cli/smoketest.py: a refusal before the boot (here the registry's 404) is the refusal's
    status, never 0 with a FAIL line, and the --json result names why."""
    missing = f"{registry.host}/codes-{uuid.uuid4().hex[:8]}:absent"
    result = run_launcher("test", "--json", INSECURE, "--cache-dir", tmp_path / "cache", missing)
    assert result.code == Exit.NOT_FOUND, (result.out, result.err)
    doc = json.loads(result.out)
    assert doc["result"] == "fail" and "absent" in doc["reason"]
