"""Private container engines started by the tests: a dockerd and a `podman system service`.

Both run as children of the test process with every path under a short temp dir (unix socket paths
are limited to 107 bytes), no bridge, no iptables, no ip_forward: they never touch the host's
network, and images only reach them from archives the tests build. A daemon that does not come up
fails the test with its log; nothing is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from tests.procs import terminate

READY_TIMEOUT = 60.0


@dataclass
class Engine:
    kind: str  # "docker" or "podman"
    root: Path
    socket: Path
    proc: subprocess.Popen
    env: dict  # what a client process needs to reach this engine (DOCKER_HOST, and podman's configs)

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, version="1.40", timeout=300)

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.root, ignore_errors=True)


def _wait_ready(engine: Engine, log: Path) -> Engine:
    deadline = time.monotonic() + READY_TIMEOUT
    last = None
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            break
        if engine.socket.exists():
            try:
                engine.client().ping()
                return engine
            except Exception as exc:  # noqa: BLE001  (not up yet: keep the last reason for the failure)
                last = exc
        time.sleep(0.2)
    text = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    engine.stop()
    pytest.fail(f"{engine.kind} did not start ({last}); its log:\n{text}")


def _short_root(prefix: str) -> Path:
    # /tmp rather than pytest's tmp_path: the socket path must stay short.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_dockerd() -> Engine:
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is not installed (scripts/setup.sh installs docker.io)")
    root = _short_root("dkd")
    sock = root / "d.sock"
    log = root / "dockerd.log"
    cmd = [
        "dockerd", "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false",
        "--bridge=none", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
        "--pidfile", str(root / "d.pid"), "-H", f"unix://{sock}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine("docker", root, sock, proc, {"DOCKER_HOST": f"unix://{sock}"})
    return _wait_ready(engine, log)


def podman_env(root: Path) -> dict:
    """A private storage and containers.conf, so the host's podman images are never seen or changed."""
    storage = root / "storage.conf"
    storage.write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n'
    )
    conf = root / "containers.conf"
    conf.write_text('[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n')
    return {"CONTAINERS_STORAGE_CONF": str(storage), "CONTAINERS_CONF": str(conf)}


def start_podman() -> Engine:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed (scripts/setup.sh installs it)")
    root = _short_root("pdm")
    sock = root / "p.sock"
    log = root / "podman.log"
    env = podman_env(root)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{sock}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env},
        )
    engine = Engine("podman", root, sock, proc, {**env, "DOCKER_HOST": f"unix://{sock}", "CONTAINER_HOST": f"unix://{sock}"})
    return _wait_ready(engine, log)


@pytest.fixture(scope="session")
def dockerd():
    engine = start_dockerd()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def podman():
    engine = start_podman()
    yield engine
    engine.stop()


@pytest.fixture(params=["docker", "podman"])
def engine(request):
    return request.getfixturevalue("dockerd" if request.param == "docker" else "podman")
