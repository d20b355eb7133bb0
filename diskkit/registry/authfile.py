"""Registry credentials found where skopeo and podman look, in the same order.

`--creds` first, then `--authfile` or `$REGISTRY_AUTH_FILE` (alone), else `${XDG_RUNTIME_DIR}/containers/auth.json`
(`/run/containers/$UID/auth.json` when XDG_RUNTIME_DIR is unset), `${XDG_CONFIG_HOME:-~/.config}/containers/auth.json`,
`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`, and the legacy `~/.dockercfg`. In each file `credHelpers[host]` wins over
`auths`, and `credsStore` serves hosts without an inline entry, through the
`docker-credential-<name> get` protocol.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from diskkit.errors import DiskkitError

@dataclass(frozen=True)
class Credentials:
    username: str
    password: str
    identity_token: str | None = None  # an OAuth2 refresh token from `docker login` with some registries

    def __repr__(self) -> str:  # never print secrets, even in tracebacks
        return f"Credentials(username={self.username!r}, password=***)"


def parse_creds(value: str) -> Credentials:
    user, sep, password = value.partition(":")
    if not sep or not user:
        raise DiskkitError("--creds", "must be USERNAME:PASSWORD")
    return Credentials(user, password)


def candidate_files(authfile: str | None) -> list[Path]:
    if authfile:
        return [Path(authfile)]
    env = os.environ.get("REGISTRY_AUTH_FILE")
    if env:
        return [Path(env)]
    # containers/image pkg/docker/config/config.go: getPathToAuthWithOS, then getAuthFilePaths
    files = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        files.append(Path(runtime) / "containers" / "auth.json")
    else:  # where `skopeo login` writes as root with no session (sudo, su, a container, cron)
        files.append(Path(f"/run/containers/{os.getuid()}/auth.json"))
    home = Path(os.path.expanduser("~"))
    config_home = os.environ.get("XDG_CONFIG_HOME")
    files.append((Path(config_home) if config_home else home / ".config") / "containers" / "auth.json")
    docker_config = os.environ.get("DOCKER_CONFIG")
    files.append(Path(docker_config) / "config.json" if docker_config else home / ".docker" / "config.json")
    files.append(home / ".dockercfg")
    return files


def _host_keys(registry: str) -> list[str]:
    """The spellings auth files use for a registry; Docker Hub has its historic index URL."""
    keys = [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/", f"https://{registry}/v2/"]
    if registry in ("docker.io", "registry-1.docker.io"):
        keys += ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io", "docker.io"]
    return keys


def _decode(entry: dict, source: Path) -> Credentials | None:
    if entry.get("identitytoken"):
        user = entry.get("username") or "<token>"
        return Credentials(user, "", entry["identitytoken"])
    auth = entry.get("auth")
    if auth:
        try:
            user, _, password = base64.b64decode(auth).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise DiskkitError(source, "an 'auth' entry is not base64 of USER:PASSWORD") from None
        return Credentials(user, password)
    if entry.get("username"):
        return Credentials(entry["username"], entry.get("password", ""))
    return None


def in_config(data: dict, registry: str, source: object) -> Credentials | None:
    """The inline `auths` entry for `registry` of a docker config (a pull Secret's, say); no helpers."""
    auths = data.get("auths") if isinstance(data.get("auths"), dict) else {}
    for key in _host_keys(registry):
        entry = auths.get(key)
        if isinstance(entry, dict):
            found = _decode(entry, source)
            if found:
                return found
    return None


def helper_credentials(helper: str, registry: str) -> Credentials | None:
    """`docker-credential-<helper> get`, given the server URL on stdin, answering JSON."""
    program = f"docker-credential-{helper}"
    try:
        proc = subprocess.run([program, "get"], input=registry.encode(), capture_output=True, timeout=30)
    except FileNotFoundError:
        raise DiskkitError(program, f"credential helper for {registry} is not installed") from None
    except subprocess.TimeoutExpired:
        raise DiskkitError(program, f"credential helper for {registry} did not answer within 30 s") from None
    if proc.returncode != 0:
        text = proc.stdout.decode(errors="replace").strip() + proc.stderr.decode(errors="replace").strip()
        if "credentials not found" in text.lower():
            return None
        raise DiskkitError(program, f"credential helper failed for {registry} (exit {proc.returncode})")
    try:
        answer = json.loads(proc.stdout)
        user, secret = answer["Username"], answer["Secret"]
    except (ValueError, KeyError, TypeError):
        raise DiskkitError(program, "credential helper answered something other than {Username, Secret} JSON") from None
    if user == "<token>":
        return Credentials(user, "", secret)
    return Credentials(user, secret)


def out_of_reach(authfile: str | None = None) -> list[str]:
    """The default auth files this user cannot even look for, each with the directory in the way: a
    /run/containers that root's podman or skopeo made 0700 hides /run/containers/$UID/auth.json from
    its owner, and a 401 should say so rather than suggest a login that would be read from there."""
    if authfile or os.environ.get("REGISTRY_AUTH_FILE"):
        return []
    found = []
    for path in candidate_files(None):
        try:
            path.is_file()
            continue
        except PermissionError:
            pass
        blocker = next((parent for parent in reversed(path.parents) if not os.access(parent, os.X_OK)), path.parent)
        try:
            st = blocker.stat()
            how = f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}"
        except OSError:
            how = "unreadable"
        found.append(f"{path} cannot be read: {blocker} is not searchable by uid {os.getuid()} ({how})")
    return found


def lookup(registry: str, creds: str | None = None, authfile: str | None = None) -> Credentials | None:
    if creds:
        return parse_creds(creds)
    for path in candidate_files(authfile):
        try:
            present = path.is_file()
        except PermissionError:  # another user's runtime or home directory: not ours to read
            present = False
        if not present:
            if authfile:
                raise DiskkitError(path, "auth file does not exist")
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DiskkitError(path, f"auth file cannot be parsed ({exc.__class__.__name__})") from None
        if path.name == ".dockercfg":
            data = {"auths": data}
        helpers = data.get("credHelpers") or {}
        for key in _host_keys(registry):
            if key in helpers:
                return helper_credentials(helpers[key], registry)
        auths = data.get("auths") or {}
        for key in _host_keys(registry):
            if key in auths:
                found = _decode(auths[key] or {}, path)
                if found:
                    return found
        if data.get("credsStore"):
            found = helper_credentials(data["credsStore"], registry)
            if found:
                return found
    return None


def held(registry: str, opts) -> Credentials | None:
    """The credentials a request to `registry` with these options sends: the ones they carry inline
    for it when they carry inline credentials at all (a VMI's pull secret, a client of another user
    that sent its own or none), else `--creds` or the auth files."""
    if opts.inline_credentials is not None:
        return dict(opts.inline_credentials).get(registry)
    return lookup(registry, opts.creds, opts.authfile)
