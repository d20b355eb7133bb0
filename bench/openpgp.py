"""Measure the OpenPGP backends diskkit could use for GPG simple signing.

  gpg        diskkit.signing.openpgp: the `gpg` binary (sign from $GNUPGHOME, verify in a throw-away
             home the policy's keys are imported into, as containers/image's gpgme build does)
  pysequoia  pysequoia (Sequoia-PGP in a wheel): verify against the exported keyring, sign with an
             exported secret key (it cannot reach keys held by gpg-agent)
  pgpy       PGPy: verify only (it warns that it checks neither self-signatures nor revocations)

For each backend and key type (rsa3072, ed25519): median sign and verify latency over --runs, and
the installed size of the package. The libraries are measured only when importable; put them in a
scratch venv, never in the project's:

    python3 -m venv /tmp/pgpbench && /tmp/pgpbench/bin/pip install pysequoia==0.1.35 PGPy==0.6.0
    PYTHONPATH=. /tmp/pgpbench/bin/python bench/openpgp.py --runs 20
    .venv/bin/python bench/openpgp.py            # gpg alone
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

PAYLOAD = (b'{"critical":{"identity":{"docker-reference":"registry.example/disks/fedora:40"},"image":{"docker-manifest-digest":"sha256:'
           + b"0" * 64 + b'"},"type":"atomic container signature"},"optional":{"creator":"bench","timestamp":1700000000}}')


def _median_ms(fn, runs: int) -> float:
    fn()  # warm: agent started, modules imported
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _size_mb(module: str) -> float | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from diskkit.signing import openpgp

    results = []
    with tempfile.TemporaryDirectory(prefix="pgpbench-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir(mode=0o700)
        os.environ["GNUPGHOME"] = str(home)
        gpg = ["gpg", "--batch", "--no-tty", "--pinentry-mode", "loopback", "--passphrase", ""]
        try:
            for algo in ("rsa3072", "ed25519"):
                uid = f"bench-{algo} <{algo}@bench.invalid>"
                subprocess.run([*gpg, "--quick-gen-key", uid, algo, "sign", "never"], check=True, capture_output=True)
                fpr = next(l.split(":")[9] for l in subprocess.run(["gpg", "--with-colons", "-K", uid], capture_output=True, text=True, check=True).stdout.splitlines() if l.startswith("fpr"))
                public = subprocess.run(["gpg", "--export", fpr], capture_output=True, check=True).stdout
                secret = subprocess.run([*gpg, "--export-secret-keys", fpr], capture_output=True, check=True).stdout
                sig = openpgp.sign(PAYLOAD, fpr)
                results.append({"backend": "gpg", "key": algo, "sign_ms": _median_ms(lambda: openpgp.sign(PAYLOAD, fpr), args.runs),
                                "verify_ms": _median_ms(lambda: openpgp.verify(sig, [public]), args.runs), "installed_mb": 0.0})
                if importlib.util.find_spec("pysequoia"):
                    import pysequoia

                    cert = pysequoia.Cert.from_bytes(secret)
                    certs = pysequoia.Cert.split_bytes(public)
                    results.append({"backend": "pysequoia", "key": algo,
                                    "sign_ms": _median_ms(lambda: pysequoia.sign(cert.secrets.signer(), PAYLOAD), args.runs),
                                    "verify_ms": _median_ms(lambda: pysequoia.verify(sig, lambda ids: certs), args.runs),
                                    "installed_mb": _size_mb("pysequoia")})
                if importlib.util.find_spec("pgpy"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        import pgpy

                        key, _ = pgpy.PGPKey.from_blob(public)

                        def pgpy_verify():
                            message = pgpy.PGPMessage.from_blob(sig)
                            assert key.verify(message)

                        results.append({"backend": "pgpy", "key": algo, "sign_ms": None, "verify_ms": _median_ms(pgpy_verify, args.runs),
                                        "installed_mb": _size_mb("pgpy")})
        finally:
            subprocess.run(["gpgconf", "--kill", "gpg-agent"], check=False)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {args.runs} runs, medians")
    for r in results:
        sign = f"{r['sign_ms']:.1f} ms" if r["sign_ms"] is not None else "n/a"
        size = f"{r['installed_mb']:.1f} MB" if r["installed_mb"] is not None else "?"
        print(f"{r['backend']:10} {r['key']:8} sign {sign:>9}  verify {r['verify_ms']:.1f} ms  installed {size}")


if __name__ == "__main__":
    sys.exit(main())
