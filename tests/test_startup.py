"""What a CLI run imports before it does anything: the signing stack (cryptography, nacl, yaml)
costs ~0.09 s of every run, so it loads only when a command signs or a policy names keys; zstd
only when a layer is zstd."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
