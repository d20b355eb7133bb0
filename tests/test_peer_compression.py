"""Which peer reads which layer compression, measured here: the same disk built with gzip, zstd and
none, then read by skopeo, umoci, podman, buildah (from an OCI layout) and docker 20.10 (pulled from
a loopback registry). The docs/build.md table is this matrix; the test fails when they disagree."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit
from tests.engines import podman_env

KINDS = ("gzip", "zstd", "none")
PEERS = ("skopeo 1.9", "umoci 0.4.7", "podman 4.3", "buildah 1.28", "docker 20.10")
TABLE_DOC = Path(__file__).resolve().parent.parent / "docs/build.md"


def _ok(cmd: list[str], env: dict | None = None) -> bool:
    return subprocess.run(cmd, capture_output=True, env={**os.environ, **(env or {})}, timeout=300).returncode == 0


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, registry, dockerd) -> dict:
    root = tmp_path_factory.mktemp("peers")
    store = root / "store"
    store.mkdir()
    storage = podman_env(store)
    out = {}
    for index, kind in enumerate(KINDS):
        # A disk of its own per kind: an engine that already holds a layer with the same diffID
        # (the same tar, compressed otherwise) skips the download and would seem to read anything.
        (root / kind).mkdir()
        disk = make_qcow2(root / kind / "d.qcow2", "16M", 0x66 + index)
        layout = root / f"l-{kind}"
        assert run_diskkit("build", disk, "--compression", kind, "-t", f"oci:{layout}:v1").code == 0
        remote = f"{registry.host}/peers/{kind}:v1"
        assert run_diskkit("push", "--tls-verify=false", f"oci:{layout}:v1", remote).code == 0
        bundle = root / f"bundle-{kind}"
        out[kind] = {
            # Recompressing to gzip makes skopeo read every layer through. (Into docker-archive it refuses
            # zstd before reading: "zstd compression is not supported for docker images".)
            "skopeo 1.9": _ok(["skopeo", "copy", "--dest-compress", "--dest-compress-format", "gzip", f"oci:{layout}:v1", f"oci:{root / 'sk'}-{kind}:v1"]),
            "umoci 0.4.7": _ok(["umoci", "unpack", "--image", f"{layout}:v1", str(bundle)]) and (bundle / "rootfs" / "disk" / "d.qcow2").is_file(),
            "podman 4.3": _ok(["podman", "pull", "-q", f"oci:{layout}:v1"], storage),
            "buildah 1.28": _ok(["buildah", "pull", "-q", f"oci:{layout}:v1"], {**storage, "STORAGE_DRIVER": "vfs"}),
            # dockerd treats 127.0.0.0/8 registries as insecure by itself: plain HTTP on loopback.
            "docker 20.10": _pull_with_docker(dockerd, remote),
        }
    return out


def _pull_with_docker(engine, name: str) -> bool:
    try:
        engine.client().images.pull(name)
        return True
    except Exception:  # noqa: BLE001  (the engine's refusal is the measurement)
        return False


def table(matrix: dict) -> str:
    lines = ["| reads | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for peer in PEERS:
        lines.append(f"| {peer} | " + " | ".join("yes" if matrix[k][peer] else "no" for k in KINDS) + " |")
    return "\n".join(lines)


def test_every_peer_reads_gzip_and_plain_layers(matrix):
    for kind in ("gzip", "none"):
        assert all(matrix[kind].values()), (kind, matrix[kind])


def test_readme_table_is_the_measured_matrix(matrix):
    measured = table(matrix)
    found = re.search(r"<!-- peer-compression -->\n(.*?)\n<!-- /peer-compression -->", TABLE_DOC.read_text(), re.S)
    assert found, "docs/build.md has no peer-compression table"
    assert found.group(1).strip() == measured, f"docs/build.md table differs from what was measured:\n{measured}"
