"""Where credentials come from, in skopeo's and podman's order."""

from __future__ import annotations

import base64
import json

import pytest

from diskkit.errors import DiskkitError
from diskkit.registry import authfile


def _auth(user: str, password: str) -> dict:
    return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture
def homes(tmp_path, monkeypatch):
    home, runtime = tmp_path / "home", tmp_path / "run"
    (home / ".docker").mkdir(parents=True)
    (runtime / "containers").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    return home, runtime


def test_order_creds_then_authfile_then_xdg_then_docker(homes, tmp_path, monkeypatch):
    home, runtime = homes
    (home / ".docker" / "config.json").write_text(json.dumps({"auths": {"r.example": _auth("docker", "d")}}))
    assert authfile.lookup("r.example") == authfile.Credentials("docker", "d")
    (runtime / "containers" / "auth.json").write_text(json.dumps({"auths": {"r.example": _auth("podman", "p")}}))
    assert authfile.lookup("r.example").username == "podman"
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({"auths": {"https://r.example/v2/": _auth("env", "e")}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(env_file))
    assert authfile.lookup("r.example").username == "env"
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"auths": {"r.example": _auth("flag", "f")}}))
    assert authfile.lookup("r.example", authfile=str(explicit)).username == "flag"
    assert authfile.lookup("r.example", creds="cli:secret:with:colons") == authfile.Credentials("cli", "secret:with:colons")
    assert authfile.lookup("other.example") is None


def test_docker_hub_index_url_and_identity_token(homes):
    home, _ = homes
    config = {"auths": {"https://index.docker.io/v1/": _auth("hubuser", "x"), "t.example": {"identitytoken": "refresh-me"}}}
    (home / ".docker" / "config.json").write_text(json.dumps(config))
    assert authfile.lookup("docker.io").username == "hubuser"
    token = authfile.lookup("t.example")
    assert token.identity_token == "refresh-me"
    assert "refresh-me" not in repr(token)
    assert "sekrit" not in repr(authfile.Credentials("u", "sekrit")) and "sekrit" not in str(authfile.Credentials("u", "sekrit"))


def test_bad_inputs(homes, tmp_path):
    with pytest.raises(DiskkitError, match="must be USERNAME:PASSWORD"):
        authfile.lookup("r.example", creds="nocolon")
    with pytest.raises(DiskkitError, match="auth file does not exist"):
        authfile.lookup("r.example", authfile=str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DiskkitError, match="cannot be parsed"):
        authfile.lookup("r.example", authfile=str(broken))
    helper = tmp_path / "helper.json"
    helper.write_text(json.dumps({"credHelpers": {"r.example": "nonexistent-helper-xyz"}}))
    with pytest.raises(DiskkitError, match="credential helper for r.example is not installed"):
        authfile.lookup("r.example", authfile=str(helper))


def test_xdg_config_home_comes_after_the_runtime_file_and_before_docker(homes, tmp_path, monkeypatch):
    home, runtime = homes
    config_home = tmp_path / "config"
    (config_home / "containers").mkdir(parents=True)
    (home / ".docker" / "config.json").write_text(json.dumps({"auths": {"r.example": _auth("docker", "d")}}))
    (config_home / "containers" / "auth.json").write_text(json.dumps({"auths": {"r.example": _auth("xdgconfig", "c")}}))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    assert authfile.lookup("r.example").username == "xdgconfig"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    (home / ".config" / "containers").mkdir(parents=True)
    (home / ".config" / "containers" / "auth.json").write_text(json.dumps({"auths": {"r.example": _auth("dotconfig", "c")}}))
    assert authfile.lookup("r.example").username == "dotconfig"  # ~/.config when XDG_CONFIG_HOME is unset
    (runtime / "containers" / "auth.json").write_text(json.dumps({"auths": {"r.example": _auth("runtime", "r")}}))
    assert authfile.lookup("r.example").username == "runtime"
    # containers/image pkg/docker/config/config.go: without XDG_RUNTIME_DIR the per-UID file under /run
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert authfile.candidate_files(None)[:2] == [
        authfile.Path(f"/run/containers/{__import__('os').getuid()}/auth.json"), home / ".config" / "containers" / "auth.json"]
