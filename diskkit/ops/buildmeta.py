"""`diskkit build`'s metadata flags: which platform's config a --label/--env/hint goes to, and which
level of the image an --annotation goes to (pure parsing; the build applies them).

- `--label`, `--env`, `--default-instancetype`, `--default-preference` take an optional `OS/ARCH[/VARIANT]:`
  prefix naming the one platform they are for (kubevirt/containerdisks sets a different default
  preference per architecture). The prefix reads as `--platform OS/ARCH=FILE` does, and a word before
  the first ':' is a platform only when it holds a '/' and no '=' (so `PATH=/a:/b` and
  `source=https://...` stay values); a platform the build does not make is refused, never dropped.
- `--annotation` takes docker buildx's syntax: `[TYPE[,TYPE...][\\[OS/ARCH\\]]:]KEY=VALUE`, TYPE one of
  manifest (the default, as buildx), index, manifest-descriptor (the index's entry for the manifest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from diskkit.errors import DiskkitError
from diskkit.oci import hints
from diskkit.oci.image import Platform

ANNOTATION_TYPES = ("manifest", "index", "manifest-descriptor")
_TYPE_PREFIX = re.compile(r"[a-z-]+(\[[^\]]*\])?(,[a-z-]+(\[[^\]]*\])?)*")
_ONE_TYPE = re.compile(r"([a-z-]+)(?:\[([^\]]*)\])?")


@dataclass
class Metadata:
    """What goes where: "" keys mean every platform."""

    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, list[str]] = field(default_factory=dict)
    manifest_annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    descriptor_annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    index_annotations: dict[str, str] = field(default_factory=dict)

    def labels_for(self, plat: Platform) -> dict[str, str]:
        return {**self.labels.get("", {}), **self.labels.get(str(plat), {})}

    def env_for(self, plat: Platform) -> list[str]:
        """Every platform's variables, then this one's; a later one replaces an earlier one of the same name."""
        merged: dict[str, str] = {}
        for entry in [*self.env.get("", []), *self.env.get(str(plat), [])]:
            merged[entry.partition("=")[0]] = entry
        return list(merged.values())

    def annotations_for(self, plat: Platform) -> dict[str, str]:
        return {**self.manifest_annotations.get("", {}), **self.manifest_annotations.get(str(plat), {})}

    def descriptor_for(self, plat: Platform) -> dict[str, str]:
        return {**self.descriptor_annotations.get("", {}), **self.descriptor_annotations.get(str(plat), {})}


def platform_prefix(value: str, flag: str, built: list[Platform]) -> tuple[str, str]:
    """("" or the platform's text, the rest) for a value with an optional OS/ARCH: prefix; a platform
    not in `built` is refused."""
    head, sep, rest = value.partition(":")
    if not sep or "/" not in head or "=" in head:
        return "", value
    return _built(Platform.parse(head), f"{flag} {value}", built), rest


def _built(plat: Platform, subject: str, built: list[Platform]) -> str:
    if plat not in built:
        raise DiskkitError(subject, f"{plat} is not a platform this build makes ({', '.join(str(p) for p in built)})")
    return str(plat)


def _pair(value: str, subject: str) -> tuple[str, str]:
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise DiskkitError(subject, "must be KEY=VALUE")
    return key, val


def parse(built: list[Platform], index: bool, labels=(), env=(), annotations=(), instancetype=(), preference=()) -> Metadata:
    """The build's metadata flags, checked against the platforms it makes (`index`: it writes an index)."""
    out = Metadata()
    for value in labels:
        where, rest = platform_prefix(value, "--label", built)
        key, val = _pair(rest, f"--label {value}")
        out.labels.setdefault(where, {})[key] = val
    for value in env:
        where, rest = platform_prefix(value, "--env", built)
        _pair(rest, f"--env {value}")
        out.env.setdefault(where, []).append(rest)
    for what, flag, values in (("instancetype", "--default-instancetype", instancetype), ("preference", "--default-preference", preference)):
        for value in values:
            where, rest = platform_prefix(value, flag, built)
            pairs = hints.hint_pairs(what, rest, f"{flag} {value}")
            out.labels.setdefault(where, {}).update(pairs)
            out.env.setdefault(where, []).extend(f"{hints.env_name(k)}={v}" for k, v in pairs.items())
    for value in annotations:
        _annotation(value, built, index, out)
    return out


def _annotation(value: str, built: list[Platform], index: bool, out: Metadata) -> None:
    subject = f"--annotation {value}"
    keypart, sep, val = value.partition("=")
    prefix, colon, key = keypart.partition(":")
    if not colon or not _TYPE_PREFIX.fullmatch(prefix):
        prefix, key = "manifest", keypart
    if not sep or not key:
        raise DiskkitError(subject, "must be [TYPE[,TYPE][[OS/ARCH]]:]KEY=VALUE")
    for part in prefix.split(","):
        kind, plat_text = _ONE_TYPE.fullmatch(part).groups()
        if kind not in ANNOTATION_TYPES:
            raise DiskkitError(subject, f"unknown annotation type {kind!r} (one of {', '.join(ANNOTATION_TYPES)})")
        where = _built(Platform.parse(plat_text), subject, built) if plat_text else ""
        if kind == "index":
            if where:
                raise DiskkitError(subject, "an index annotation has no platform")
            if not index:
                # buildx: the build must make the component annotated.
                raise DiskkitError(subject, "this build writes no index (give --platform OS/ARCH=FILE for each platform)")
            out.index_annotations[key] = val
        elif kind == "manifest-descriptor":
            if not index:
                raise DiskkitError(subject, "this build writes no index for the descriptor to sit in (give --platform OS/ARCH=FILE for each platform)")
            out.descriptor_annotations.setdefault(where, {})[key] = val
        else:
            out.manifest_annotations.setdefault(where, {})[key] = val
