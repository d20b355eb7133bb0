"""registries.d: which repositories keep sigstore signatures as attachments and where the lookaside
store of their GPG simple signatures is (containers/image docker/registries_d.go)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from diskkit.errors import DiskkitError

SYSTEM_DIR = Path("/etc/containers/registries.d")


def default_dir() -> Path:
    """The user's directory when it exists, else the system one, as containers/image chooses."""
    user = Path(os.environ.get("HOME", "/")) / ".config/containers/registries.d"
    return user if user.is_dir() else SYSTEM_DIR


def load(directory: Path | None) -> dict:
    """{"default-docker": {...}, "docker": {scope: {...}}} merged from every *.yaml file in `directory`."""
    directory = Path(directory) if directory is not None else default_dir()
    merged: dict = {"default-docker": None, "docker": {}}
    if not directory.is_dir():
        return merged
    for path in sorted(directory.glob("*.yaml")):
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise DiskkitError(path, f"cannot read registries.d file: {exc}") from None
        if not isinstance(doc, dict):
            raise DiskkitError(path, "must be a YAML mapping")
        if doc.get("default-docker") is not None:
            if merged["default-docker"] is not None:
                raise DiskkitError(path, "default-docker is defined in more than one file of the directory")
            merged["default-docker"] = doc["default-docker"]
        for scope, value in (doc.get("docker") or {}).items():
            if scope in merged["docker"]:
                raise DiskkitError(path, f"docker namespace {scope} is defined in more than one file")
            merged["docker"][scope] = value or {}
    return merged


def uses_attachments(config: dict, identity: str, namespaces: list[str]) -> bool:
    """The most specific entry that sets the key wins (full reference, then namespaces), else default-docker."""
    for scope in [identity, *namespaces]:
        entry = config["docker"].get(scope) or {}
        if "use-sigstore-attachments" in entry:
            return bool(entry["use-sigstore-attachments"])
    return bool((config["default-docker"] or {}).get("use-sigstore-attachments", False))


def _top_level(entry: dict | None, write: bool) -> str:
    """The entry's lookaside URL: for writing the staging one first; the older sigstore* names after."""
    entry = entry or {}
    names = ("lookaside-staging", "sigstore-staging", "lookaside", "sigstore") if write else ("lookaside", "sigstore")
    return next((str(entry[n]) for n in names if entry.get(n)), "")


def configured_lookaside(config: dict, identity: str, namespaces: list[str], write: bool) -> str:
    """The lookaside URL the most specific entry names (the reference, its namespaces, default-docker); "" when none does."""
    for scope in [identity, *namespaces]:
        top = _top_level(config["docker"].get(scope), write)
        if top:
            return top
    return _top_level(config["default-docker"], write)


def builtin_lookaside() -> str:
    """Where containers/image keeps signatures no registries.d entry places (docker/registries_d.go,
    builtinDefaultLookasideStorageDir): /var/lib/containers/sigstore as root, else the user's own."""
    if os.geteuid() == 0:
        return "file:///var/lib/containers/sigstore"
    return (Path(os.environ.get("HOME", "/")) / ".local/share/containers/sigstore").as_uri()


def lookaside_base(config: dict, identity: str, namespaces: list[str], repository: str, write: bool) -> str:
    """The lookaside URL of a repository: the most specific entry naming one, else the built-in local
    store; the repository path (without the registry host) appended, as lookasideStorageBaseURL does."""
    top = configured_lookaside(config, identity, namespaces, write) or builtin_lookaside()
    return top.rstrip("/") + "/" + repository
