"""`--skip-if-label KEY=VALUE`: the rebuild check of KubeVirt's image pipeline, made before a build.

kubevirt/containerdisks (cmd/medius/images/push.go, rebuildNeeded) reads the published image's
config for each architecture it would build and rebuilds when any one's label differs; a missing
repository, tag or architecture means "build it", any other failure to read is an error.
"""

from __future__ import annotations

import json

from diskkit.errors import DiskkitError
from diskkit.oci.image import Platform
from diskkit.oci.reference import parse_ref
from diskkit.registry.options import RegistryOptions


def parse_pairs(values: tuple[str, ...] | list[str], platforms: list[Platform]) -> dict[str, dict[str, str]]:
    """KEY=VALUE for every platform, OS/ARCH:KEY=VALUE for one (as --label takes them): platform text
    ("" for all) -> the labels its image must carry."""
    from diskkit.ops.buildmeta import platform_prefix

    wanted: dict[str, dict[str, str]] = {}
    for value in values:
        where, rest = platform_prefix(value, "--skip-if-label", platforms)
        key, sep, val = rest.partition("=")
        if not sep or not key:
            raise DiskkitError(f"--skip-if-label {value}", "must be KEY=VALUE (or OS/ARCH:KEY=VALUE)")
        scope = wanted.setdefault(where, {})
        if key in scope and scope[key] != val:
            raise DiskkitError(f"--skip-if-label {key}", "given twice with different values")
        scope[key] = val
    return wanted


def _missing(exc: DiskkitError) -> bool:
    """A tag, repository or platform the destination does not have yet: a build makes it."""
    rule = exc.rule or ""
    return (rule.startswith("manifest ") and " not found" in rule) or rule.startswith("no image for platform")


def already_there(dest: str, platforms: list[Platform], wanted: dict[str, dict[str, str]], registry: RegistryOptions | None) -> str | None:
    """Why nothing needs doing (every platform's image at `dest` carries every label wanted of it:
    `wanted` as parse_pairs gives it), or None."""
    from diskkit.transports import open_source

    ref = parse_ref(dest)
    if ref.transport != "docker":
        raise DiskkitError(f"--skip-if-label {dest}", "reads a registry tag's labels; the destination is not in a registry")
    if ref.name.digest:
        raise DiskkitError(f"--skip-if-label {dest}", "needs a tag to compare with, not a digest")
    with open_source(ref, registry or RegistryOptions()) as source:
        for platform in platforms:
            try:
                image = source.image(platform)
            except DiskkitError as exc:
                if _missing(exc):
                    return None
                raise
            try:
                config = json.loads(image.config_bytes)
                labels = (config.get("config") or {}).get("Labels") or {}
                same_platform = platform.matches({"os": config.get("os"), "architecture": config.get("architecture"), "variant": config.get("variant")})
            except (ValueError, AttributeError):
                raise DiskkitError(f"{dest}", "image config is not a JSON object") from None
            expected = {**wanted.get("", {}), **wanted.get(str(platform), {})}
            if not same_platform or any(labels.get(k) != v for k, v in expected.items()):
                return None
    shown = ", ".join(f"{where + ':' if where else ''}{k}={v}" for where, pairs in wanted.items() for k, v in pairs.items())
    return f"{dest}: nothing done, its image already carries {shown}"
