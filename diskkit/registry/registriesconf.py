"""registries.conf (v2) and its drop-ins, read in the places and order podman and skopeo read them
(containers/image pkg/sysregistriesv2/system_registries_v2.go), and short-name resolution as podman
does it without a terminal (pkg/shortnames/shortnames.go).

`load()` is the only function that touches files; the rest is pure.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.oci.reference import DockerName, parse_docker_name

SYSTEM_CONF = Path("/etc/containers/registries.conf")
SYSTEM_DIR = Path("/etc/containers/registries.conf.d")
USER_CONF = ".config/containers/registries.conf"
USER_DIR = ".config/containers/registries.conf.d"
# Aliases podman records after a prompt (pkg/sysregistriesv2/shortnames.go: the alias cache file).
SYSTEM_ALIAS_CACHE = Path("/var/cache/containers/short-name-aliases.conf")
USER_ALIAS_CACHE = ".cache/containers/short-name-aliases.conf"
_DOMAIN = re.compile(r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?))*(?::[0-9]+)?$|^\[[0-9a-fA-F:.]+\](?::[0-9]+)?$")


@dataclass(frozen=True)
class Endpoint:
    location: str
    insecure: bool = False
    pull_from_mirror: str = ""  # "", "all", "digest-only", "tag-only"


@dataclass(frozen=True)
class RegistryEntry:
    prefix: str
    endpoint: Endpoint
    mirrors: tuple[Endpoint, ...] = ()
    blocked: bool = False
    mirror_by_digest_only: bool = False


@dataclass(frozen=True)
class PullSource:
    name: DockerName  # the reference rewritten to this endpoint's location
    insecure: bool
    mirror: bool


@dataclass
class RegistriesConf:
    registries: dict[str, RegistryEntry] = field(default_factory=dict)  # by prefix
    search: list[str] | None = None
    mode: str | None = None  # short-name-mode; None until some file sets it
    aliases: dict[str, str] = field(default_factory=dict)
    sources: str = ""  # what was read, for error lines

    def merge(self, other: "RegistriesConf") -> None:
        """A drop-in's settings replace the same prefixes, aliases and keys; the rest stays."""
        self.registries.update(other.registries)
        if other.search is not None:
            self.search = other.search
        if other.mode is not None:
            self.mode = other.mode
        self.aliases.update(other.aliases)

    def find(self, name: str) -> RegistryEntry | None:
        """The entry with the longest prefix matching `name` (HOST/REPO[:TAG|@DIGEST])."""
        best, length = None, 0
        for prefix, entry in self.registries.items():
            if _prefix_match(name, prefix) and len(prefix) > length:
                best, length = entry, len(prefix)
        return best

    def pull_sources(self, name: DockerName) -> list[PullSource]:
        """Mirrors in order, then the registry itself; refuses a blocked one."""
        text = str(name)
        entry = self.find(text)
        if entry is None:
            return [PullSource(name, False, False)]
        if entry.blocked:
            raise DiskkitError(text, f"registry {name.registry} is blocked in {self.sources}")
        digested = name.digest is not None
        mirrors = []
        for mirror in entry.mirrors:
            if entry.mirror_by_digest_only and not digested:
                continue
            if (mirror.pull_from_mirror == "digest-only" and not digested) or (mirror.pull_from_mirror == "tag-only" and digested):
                continue
            mirrors.append(mirror)
        out = [PullSource(_rewrite(name, entry.prefix, m.location), m.insecure, True) for m in mirrors]
        out.append(PullSource(_rewrite(name, entry.prefix, entry.endpoint.location), entry.endpoint.insecure, False))
        return out

    def push_target(self, name: DockerName) -> PullSource:
        """Pushes go to the reference as written: no mirror, no rewrite; `blocked` and `insecure` apply."""
        entry = self.find(str(name))
        if entry is not None and entry.blocked:
            raise DiskkitError(str(name), f"registry {name.registry} is blocked in {self.sources}")
        return PullSource(name, bool(entry and entry.endpoint.insecure), False)

    def short_name_candidates(self, short: str) -> list[DockerName]:
        """What a short name may mean, in the order podman tries them when it cannot prompt."""
        repo, tag, digest = _split_short(short)
        alias = self.aliases.get(repo)
        suffix = (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
        if alias:
            return [parse_docker_name(alias + suffix, "short-name alias")]
        if not self.search:
            raise DiskkitError(short, f"short-name {short!r} did not resolve to an alias and no unqualified-search registries are defined in {self.sources}")
        candidates = [parse_docker_name(f"{registry}/{repo}{suffix}", "short name") for registry in self.search]
        if (self.mode or "permissive") == "enforcing" and len(candidates) > 1:
            raise DiskkitError(short, "short-name resolution enforced but cannot prompt without a TTY")
        return candidates


def _prefix_match(ref: str, prefix: str) -> bool:
    if prefix.startswith("*."):
        host = ref.split("/", 1)[0]
        return host.endswith(prefix[1:]) and host != prefix[2:]
    if ref == prefix:
        return True
    return ref.startswith(prefix) and ref[len(prefix)] in ":/@"


def _rewrite(name: DockerName, prefix: str, location: str) -> DockerName:
    if prefix.startswith("*.") or not location:
        return name
    text = str(name)
    return parse_docker_name(location + text[len(prefix):], "rewritten reference")


def _split_short(short: str) -> tuple[str, str | None, str | None]:
    name, _, digest = short.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def is_short(text: str) -> bool:
    """A name without an explicit registry host, which podman resolves through registries.conf."""
    first, slash, _ = text.partition("/")
    return not slash or not ("." in first or ":" in first or first == "localhost" or first.startswith("["))


# --- parsing (pure: text in, RegistriesConf out) -------------------------------------------------


def _location(value, where: str) -> str:
    if not isinstance(value, str):
        raise DiskkitError(where, "location must be a string")
    trimmed = value.rstrip("/")
    if trimmed.startswith(("http://", "https://")):
        raise DiskkitError(where, f"invalid location '{value}': URI schemes are not supported")
    return trimmed


def parse(text: str, where: str, drop_in: bool = False) -> RegistriesConf:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DiskkitError(where, f"is not valid TOML ({exc})") from None
    if "registries" in doc and isinstance(doc["registries"], dict):
        raise DiskkitError(where, "registry must be in v2 format but is in v1" if drop_in else "v1 registries.conf ([registries.search]) is not supported; use the v2 format")
    conf = RegistriesConf(sources=where)
    for i, raw in enumerate(doc.get("registry") or []):
        entry = _entry(raw, f"{where}: [[registry]] {i + 1}")
        conf.registries.setdefault(entry.prefix, entry)  # the first of a prefix wins, as in containers/image
    _check_conflicts(conf, where)
    if "unqualified-search-registries" in doc:
        search = [_location(r, where) for r in doc["unqualified-search-registries"]]
        for registry in search:
            if not _DOMAIN.match(registry):
                raise DiskkitError(where, f"Invalid unqualified-search-registries entry {registry!r}")
        conf.search = search
    if "short-name-mode" in doc and doc["short-name-mode"]:
        if doc["short-name-mode"] not in ("disabled", "enforcing", "permissive"):
            raise DiskkitError(where, f"invalid short-name mode: {doc['short-name-mode']!r}")
        conf.mode = doc["short-name-mode"]
    for key, value in (doc.get("aliases") or {}).items():
        conf.aliases[_alias_key(key, where)] = _alias_value(key, value, where)
    return conf


def _entry(raw: dict, where: str) -> RegistryEntry:
    location = _location(raw.get("location", ""), where)
    prefix = _location(raw.get("prefix", ""), where) if raw.get("prefix") else ""
    if not prefix:
        if not location:
            raise DiskkitError(where, "invalid condition: both location and prefix are unset")
        prefix = location
    elif not prefix.startswith("*.") and not location:
        raise DiskkitError(where, "invalid condition: location is unset and prefix is not in the format: *.example.com")
    if prefix.startswith("*.") and any(c in prefix for c in "/@:"):
        raise DiskkitError(where, f"Wildcarded prefix should be in the format: *.example.com. Current prefix {prefix!r} is incorrectly formatted")
    if raw.get("pull-from-mirror"):
        raise DiskkitError(where, f"pull-from-mirror must not be set for a non-mirror registry {prefix!r}")
    by_digest = bool(raw.get("mirror-by-digest-only", False))
    mirrors = []
    for mirror in raw.get("mirror") or []:
        mlocation = _location(mirror.get("location", ""), where)
        if not mlocation:
            raise DiskkitError(where, "invalid condition: mirror location is unset")
        usage = mirror.get("pull-from-mirror", "")
        if by_digest and usage:
            raise DiskkitError(where, f"cannot set mirror usage mirror-by-digest-only for the registry ({prefix!r}) and pull-from-mirror for per-mirror ({mlocation!r}) at the same time")
        if usage not in ("", "all", "digest-only", "tag-only"):
            raise DiskkitError(where, f"unsupported pull-from-mirror value {usage!r} for mirror {mlocation!r}")
        mirrors.append(Endpoint(mlocation, bool(mirror.get("insecure", False)), usage))
    return RegistryEntry(prefix, Endpoint(location, bool(raw.get("insecure", False))), tuple(mirrors), bool(raw.get("blocked", False)), by_digest)


def _check_conflicts(conf: RegistriesConf, where: str) -> None:
    seen: dict[str, RegistryEntry] = {}
    for entry in conf.registries.values():
        key = entry.endpoint.location or entry.prefix
        other = seen.setdefault(key, entry)
        if other.endpoint.insecure != entry.endpoint.insecure:
            raise DiskkitError(where, f"registry '{key}' is defined multiple times with conflicting 'insecure' setting")
        if other.blocked != entry.blocked:
            raise DiskkitError(where, f"registry '{key}' is defined multiple times with conflicting 'blocked' setting")


def _alias_key(key: str, where: str) -> str:
    if not is_short(key) or any(c in key.rpartition("/")[2] for c in ":@"):
        raise DiskkitError(where, f"invalid short name {key!r}: must not be fully qualified nor carry a tag or digest")
    return key


def _alias_value(key: str, value, where: str) -> str:
    if not isinstance(value, str) or is_short(value):
        raise DiskkitError(where, f"alias {key!r}: {value!r} must be a fully qualified name")
    name = parse_docker_name(value, f"alias {key}")
    if name.digest or ":" in value.rpartition("/")[2]:
        raise DiskkitError(where, f"alias {key!r}: {value!r} must not carry a tag or digest")
    return value


# --- the files (the one place that reads) --------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DiskkitError(path, f"cannot be read ({exc.strerror})") from None


def load(env: dict | None = None) -> RegistriesConf:
    """The merged configuration: CONTAINERS_REGISTRIES_CONF, else the user's file if it exists, else
    the system's; then the drop-in directories' *.conf files in name order (system's, then user's,
    except that a user registries.conf brings only the user directory); then the alias cache."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    explicit = env.get("CONTAINERS_REGISTRIES_CONF")
    user_conf = home / USER_CONF
    if explicit:
        main, dirs = Path(explicit), [SYSTEM_DIR, home / USER_DIR]
    elif user_conf.exists():
        main, dirs = user_conf, [home / USER_DIR]
    else:
        main, dirs = SYSTEM_CONF, [SYSTEM_DIR, home / USER_DIR]
    text = _read(main)
    if text is None and explicit:
        raise DiskkitError(main, "loading registries configuration: file does not exist (CONTAINERS_REGISTRIES_CONF)")
    conf = parse(text or "", str(main))
    conf.sources = ", ".join(str(p) for p in [main, *dirs])
    for directory in dirs:
        if directory.is_dir():
            for path in sorted(p for p in directory.iterdir() if p.name.endswith(".conf") and p.is_file()):
                drop_in = _read(path)
                if drop_in is not None:
                    conf.merge(parse(drop_in, str(path), drop_in=True))
    cache = SYSTEM_ALIAS_CACHE if os.geteuid() == 0 else home / USER_ALIAS_CACHE
    cached = _read(cache)
    if cached:
        for key, value in parse(cached, str(cache)).aliases.items():
            conf.aliases.setdefault(key, value)
    return conf

