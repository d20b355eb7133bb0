"""registries.d: which repositories keep sigstore signatures as attachments
(containers/image docker/registries_d.go). Only `use-sigstore-attachments` is read; lookaside
(`sigstore:`/`lookaside:`) URLs are for GPG signatures, which diskkit does not handle."""

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
