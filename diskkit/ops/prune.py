"""`prune`: delete the older of a repository's tags matching a pattern, keeping the newest N by the
image config's `created`, and never a digest that a tag kept still points at (a manifest is deleted
by digest, with every tag on it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

from diskkit.errors import DiskkitError, RegistryError
from diskkit.limits import MAX_CONFIG_BYTES
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import sha256_digest
from diskkit.ops.tags import Repo, get_manifest, list_tags, open_repo, repository_only, tag_digest
from diskkit.registry.client import check_status, get_blob, read_body
from diskkit.registry.options import RegistryOptions

FRACTION = re.compile(r"(\.\d{6})\d+")


@dataclass
class Plan:
    delete: dict[str, list[str]] = field(default_factory=dict)  # digest -> the matching tags going with it
    keep: dict[str, str] = field(default_factory=dict)  # matching tag -> why it stays

    def to_json(self) -> dict:
        return {"delete": [{"digest": d, "tags": t} for d, t in self.delete.items()], "keep": self.keep}


def parse_created(value: object) -> datetime | None:
    """RFC 3339 as image configs write it (Go's nanoseconds cut to Python's microseconds); None when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        when = datetime.fromisoformat(FRACTION.sub(r"\1", value.replace("Z", "+00:00")))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def plan(digests: dict[str, str], created: dict[str, datetime | None], pattern: re.Pattern, keep: int,
         children: dict[str, list[str]] | None = None) -> Plan:
    """Which digests to delete. `digests` is every tag of the repository -> its digest; `created` the
    matching tags' image times; `children` an index tag's platform manifests. The newest `keep`
    matching tags stay, as does any tag without a created time (its age unknown), every digest a
    staying tag points at, and every manifest a staying tag's index lists."""
    result = Plan()
    matching = [tag for tag in digests if pattern.fullmatch(tag)]
    dated = sorted((tag for tag in matching if created.get(tag) is not None), key=lambda t: (created[t], t), reverse=True)
    for tag in matching:
        if created.get(tag) is None:
            result.keep[tag] = "no created time in its config"
    for tag in dated[:keep]:
        result.keep[tag] = f"among the newest {keep}"
    candidates = dated[keep:]
    staying = {tag for tag in digests if tag not in candidates}
    for tag in candidates:
        holders = sorted(other for other in staying if digests[other] == digests[tag])
        listers = sorted(other for other in staying if digests[tag] in (children or {}).get(other, ()))
        if holders:
            result.keep[tag] = f"its digest {digests[tag]} is also tagged {', '.join(holders)}"
        elif listers:
            result.keep[tag] = f"its digest {digests[tag]} is in the index tagged {', '.join(listers)}"
        else:
            result.delete.setdefault(digests[tag], []).append(tag)
    return result


def _config_created(repo: Repo, manifest: dict, where: str) -> datetime | None:
    config = manifest.get("config") or {}
    digest = config.get("digest")
    if not isinstance(digest, str):
        return None
    response = get_blob(repo.registry, repo.name.repository, digest)
    data = read_body(response, MAX_CONFIG_BYTES, where, "config")
    if sha256_digest(data) != digest:
        raise RegistryError(where, f"config does not match its digest {digest}")
    try:
        return parse_created(json.loads(data).get("created"))
    except (ValueError, AttributeError):
        return None


def _children(manifest: dict, media_type: str) -> list[str]:
    if media_type not in mt.INDEXES:
        return []
    return [c["digest"] for c in manifest.get("manifests") or [] if isinstance(c, dict) and isinstance(c.get("digest"), str)]


def examine(repo: Repo, tag: str, dated: bool) -> tuple[datetime | None, list[str]]:
    """A tag's created time (when `dated`; an index's is its newest platform image's) and the
    platform manifests it lists when it is an index."""
    where = f"{repo}:{tag}"
    data, media_type = get_manifest(repo, tag, where)
    try:
        manifest = json.loads(data)
    except ValueError:
        raise RegistryError(where, "manifest is not JSON") from None
    children = _children(manifest, media_type)
    if not dated:
        return None, children
    if media_type not in mt.INDEXES:
        return _config_created(repo, manifest, where), children
    times = [_config_created(repo, json.loads(get_manifest(repo, child, where)[0]), where) for child in children]
    known = [t for t in times if t is not None]
    return (max(known) if known else None), children


def prune(ref: str, pattern: str, keep: int, opts: RegistryOptions, dry_run: bool = False) -> Plan:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise DiskkitError(f"--match {pattern}", f"not a regular expression ({exc})") from None
    name = repository_only(ref)
    repo = open_repo(name, opts, "pull" if dry_run else "pull,push,delete")
    digests = {}
    for tag in list_tags(repo):
        digest = tag_digest(repo, tag)
        if digest is not None:  # gone since the list was read
            digests[tag] = digest
    created, children = {}, {}
    for tag in digests:
        when, children[tag] = examine(repo, tag, dated=bool(regex.fullmatch(tag)))
        if regex.fullmatch(tag):
            created[tag] = when
    result = plan(digests, created, regex, keep, children)
    if dry_run:
        return result
    for digest, tags in result.delete.items():
        # A tag moved since the plan was made is left alone: its new digest was never checked.
        if any(tag_digest(repo, tag) != digest for tag in tags):
            raise RegistryError(f"{repo}:{tags[0]}", "moved while pruning; nothing more deleted (run prune again)")
        response = repo.registry.request("DELETE", f"/v2/{repo.name.repository}/manifests/{digest}", repo.scope, what="DELETE manifest")
        check_status(response, (202, 200), repo.registry.host, f"delete {digest}")
    return result
