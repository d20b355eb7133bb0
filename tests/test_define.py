"""Every golden domain is accepted by a real libvirt: defined, then undefined, in `qemu:///session` as
the unprivileged qemu user (UID 107), the way the launcher's pod runs. The schema (test_domain) only says
the XML is well formed; libvirt's parser and the qemu driver's checks at define time say it is usable.

One subprocess defines them all, against a session daemon of its own (a fresh HOME), so the test takes
about a second after libvirt's first capability probe.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher.render.domain import render, secret_xml
from tests.test_domain import CASES, load_case

QEMU_UID = 107

# Runs as UID 107. Reads [{name, xml, secrets: [{xml, value}]}] on stdin, prints {kvm, results}.
SCRIPT = r"""
import json, re, sys
import libvirt

libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
conn = libvirt.open("qemu:///session")
# A session daemon without access to /dev/kvm offers only TCG guests, and libvirt refuses to define
# a type='kvm' domain it cannot run; the KVM goldens are then defined as type='qemu', the rest unchanged.
kvm = "<domain type='kvm'" in conn.getCapabilities()
results = {}
for case in json.load(sys.stdin):
    secrets = []
    try:
        for secret in case["secrets"]:  # network disks name their credentials by usage: define those first
            secrets.append(conn.secretDefineXML(secret["xml"]))
            secrets[-1].setValue(bytes.fromhex(secret["value"]))
        xml = case["xml"] if kvm else re.sub(r'(<domain\b[^>]*\btype=)"kvm"', r'\1"qemu"', case["xml"], count=1)
        domain = conn.defineXML(xml)
        domain.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)
        results[case["name"]] = "defined"
    except libvirt.libvirtError as err:
        results[case["name"]] = str(err)
    finally:
        for secret in secrets:
            secret.undefine()
print(json.dumps({"kvm": kvm, "results": results}))
"""


def case(name: str) -> dict:
    vmi, resolved, host = load_case(name)
    sources = {disk.network for disk in resolved.values() if disk.network is not None and disk.network.secret_usage}
    secrets = [{"xml": secret_xml(source), "value": f"{source.protocol}-credential-of-{name}".encode().hex()}
               for source in sorted(sources, key=lambda s: s.secret_usage)]
    return {"name": name, "xml": render(vmi, resolved, host), "secrets": secrets}


@pytest.fixture(scope="module")
def defined() -> dict:
    try:
        gid = pwd.getpwuid(QEMU_UID).pw_gid
    except KeyError:
        pytest.fail("no user with UID 107 (scripts/setup.sh creates `qemu`)")
    # Under /tmp and world-traversable: pytest's own tmp dirs are 0700 root, which UID 107 cannot enter.
    home = Path(tempfile.mkdtemp(prefix="diskkit-define-"))
    try:
        home.chmod(0o755)
        command = [sys.executable, "-c", SCRIPT]
        if os.geteuid() == 0:
            os.chown(home, QEMU_UID, gid)
            command = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", *command]
        # Empty XDG dirs put the session daemon's socket and state under this HOME: a daemon of our own.
        env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": "", "XDG_CONFIG_HOME": "", "XDG_CACHE_HOME": ""}
        proc = subprocess.run(command, input=json.dumps([case(name) for name in CASES]), env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"the define script failed:\n{proc.stderr}"
        return json.loads(proc.stdout)
    finally:
        # The session daemon would outlive its HOME (its --timeout does not end it once that is gone).
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((home / ".cache" / "libvirt" / "libvirtd.pid").read_text().strip()), signal.SIGTERM)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("name", CASES)
def test_libvirt_defines_the_golden(defined, name):
    assert defined["results"][name] == "defined"
