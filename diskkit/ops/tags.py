"""Tags of a registry repository: list them, put a manifest under more of them, and delete one
without silently taking the other tags on the same digest along (a manifest is deleted by digest,
and with it every tag that points at it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from diskkit.errors import DiskkitError, RegistryError
from diskkit.oci.image import sha256_digest
from diskkit.oci.reference import DockerName, ImageRef, parse_ref
from diskkit.registry import registriesconf
from diskkit.registry.client import MAX_MANIFEST_BYTES, Registry, api_error_code, check_status, read_body, scope
from diskkit.registry.options import RegistryOptions
from diskkit.transports.remote import ACCEPT, not_found_code, registry_for

# distribution's reference grammar for a tag (distribution/reference/regexp.go: tag)
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
LINK_NEXT = re.compile(r'<([^>]*)>\s*;\s*rel="?next"?')


@dataclass
class Repo:
    """One repository on one registry, with the client and scope the calls go through."""

    name: DockerName
    registry: Registry
    scope: str

    def __str__(self) -> str:
        return f"{self.name.registry}/{self.name.repository}"


def docker_name(ref: str, what: str) -> DockerName:
    parsed: ImageRef = parse_ref(ref)
    if parsed.transport != "docker" or parsed.name is None:
        raise DiskkitError(ref, f"{what} works on registry references (docker://)")
    return parsed.name


def repository_only(ref: str) -> DockerName:
    """A repository reference, refused when it names a tag or digest (list-tags lists a repository)."""
    last = ref.rpartition("/")[2]
    if "@" in ref or ":" in last:
        raise DiskkitError(ref, "give a repository without a tag or digest (tags lists the whole repository)")
    name = docker_name(ref, "tags")
    return DockerName(name.registry, name.repository)


def open_repo(name: DockerName, opts: RegistryOptions, actions: str) -> Repo:
    # registries.conf's insecure and blocked, as for a push: these calls act on the repository as written
    endpoint = registriesconf.load().push_target(name)
    registry = registry_for(name.registry, opts.for_endpoint(endpoint.insecure))
    return Repo(name, registry, scope(name.repository, actions))


def next_page(link: str | None) -> str | None:
    """The path and query of the Link header's next page; its host is never followed, only its path
    on the same registry (a registry's Link names its own API)."""
    if not link:
        return None
    match = LINK_NEXT.search(link)
    if not match:
        return None
    parts = urlsplit(match.group(1))
    if not parts.path.startswith("/v2/"):
        raise DiskkitError(link, "tag list's next page is not a /v2/ API path; refused")
    return parts.path + (f"?{parts.query}" if parts.query else "")


def list_tags(repo: Repo, page: int | None = None) -> list[str]:
    """Every tag, following the Link header page by page (with `n=page` when given)."""
    path = f"/v2/{repo.name.repository}/tags/list" + (f"?n={page}" if page else "")
    tags: list[str] = []
    seen = set()
    while path:
        if path in seen:
            raise RegistryError(str(repo), "tag list pages loop back to an earlier page; refused")
        seen.add(path)
        response = repo.registry.request("GET", path, repo.scope, what="GET tags")
        if response.status_code == 404:
            raise RegistryError(str(repo), "no such repository", status=404, code=api_error_code(response) or "NAME_UNKNOWN")
        check_status(response, (200,), repo.registry.host, "GET tags")
        try:
            body = response.json()
            page_tags = body.get("tags") or []
        except (ValueError, AttributeError):
            raise RegistryError(str(repo), "tag list is not the distribution API's JSON") from None
        if not all(isinstance(tag, str) for tag in page_tags):
            raise RegistryError(str(repo), "tag list holds a value that is not a string")
        tags.extend(page_tags)
        path = next_page(response.headers.get("Link"))
    return tags


def tag_digest(repo: Repo, tag: str) -> str | None:
    """The digest a tag points at, or None when there is no such tag."""
    response = repo.registry.request("HEAD", f"/v2/{repo.name.repository}/manifests/{tag}", repo.scope, headers={"Accept": ACCEPT}, what="HEAD manifest")
    if response.status_code == 404:
        return None
    check_status(response, (200,), repo.registry.host, f"HEAD manifest {tag}")
    digest = response.headers.get("Docker-Content-Digest")
    if not digest:
        raise RegistryError(f"{repo}:{tag}", "registry did not say which digest the tag points to (no Docker-Content-Digest)")
    return digest


def tags_on(repo: Repo, digest: str, tags: list[str]) -> list[str]:
    return sorted(tag for tag in tags if tag_digest(repo, tag) == digest)


def get_manifest(repo: Repo, reference: str, where: str) -> tuple[bytes, str]:
    """A manifest's bytes and media type, checked against the digest it was asked by and the one the
    registry names."""
    response = repo.registry.request("GET", f"/v2/{repo.name.repository}/manifests/{reference}", repo.scope, headers={"Accept": ACCEPT}, stream=True, what="GET manifest")
    if response.status_code == 404:
        code = not_found_code(repo.registry, repo.scope, response, repo.name.repository)
        what = "no such repository" if code == "NAME_UNKNOWN" else "no such manifest" if reference.startswith("sha256:") else "no such tag"
        raise RegistryError(where, what, status=404, code=code)
    check_status(response, (200,), repo.registry.host, f"GET manifest {reference}")
    data = read_body(response, MAX_MANIFEST_BYTES, where, "manifest")
    media_type = (response.headers.get("Content-Type") or "").split(";")[0].strip()
    digest = sha256_digest(data)
    if reference.startswith("sha256:") and reference != digest:
        raise RegistryError(where, f"manifest hashes to {digest}, not the digest it was fetched by")
    header = response.headers.get("Docker-Content-Digest")
    if header and header != digest:
        raise RegistryError(where, f"manifest hashes to {digest}, not the registry's Docker-Content-Digest {header}")
    if not media_type:
        raise RegistryError(where, "registry gave the manifest no Content-Type")
    return data, media_type


@dataclass
class Deletion:
    reference: str
    digest: str | None
    deleted: bool
    tags_removed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"reference": self.reference, "digest": self.digest, "deleted": self.deleted, "tags_removed": self.tags_removed}


def delete(ref: str, opts: RegistryOptions, force: bool = False, ignore_missing: bool = False) -> Deletion:
    """Delete REPO:TAG's manifest, refused (unless `force`) when other tags point at the same digest."""
    name = docker_name(ref, "delete")
    repo = open_repo(name, opts, "pull,push,delete")
    shown = f"{repo}:{name.tag}" if not name.digest else f"{repo}@{name.digest}"
    digest = name.digest or tag_digest(repo, name.tag or "latest")
    if digest is None:
        if ignore_missing:
            return Deletion(shown, None, False)
        list_tags(repo)  # a missing repository is named as such (NAME_UNKNOWN), not as a missing tag
        raise RegistryError(shown, "no such tag", status=404, code="MANIFEST_UNKNOWN")
    try:
        others = tags_on(repo, digest, list_tags(repo))
    except RegistryError:
        if not name.digest:
            raise
        others = []  # a digest in a repository with no tag left: nothing else to lose
    if not name.digest:
        also = [tag for tag in others if tag != name.tag]
        if also and not force:
            raise RegistryError(shown, f"{digest} is also tagged {', '.join(also)}; deleting the manifest removes those tags too (delete by digest removes every tag on it; --force to delete anyway)")
    response = repo.registry.request("DELETE", f"/v2/{repo.name.repository}/manifests/{digest}", repo.scope, what="DELETE manifest")
    if response.status_code == 404 and ignore_missing:
        return Deletion(shown, digest, False)
    if response.status_code == 404:
        raise RegistryError(shown, f"no such manifest {digest}", status=404, code=api_error_code(response) or "MANIFEST_UNKNOWN")
    check_status(response, (202, 200), repo.registry.host, f"delete {digest}")
    return Deletion(shown, digest, True, others)


def add_tags(ref: str, new_tags: tuple[str, ...], opts: RegistryOptions) -> tuple[str, list[str]]:
    """Put REF's manifest bytes, unchanged, under each new tag of its repository: no blob moves, an index
    stays the whole index. Each stored tag is checked to point at the source's digest."""
    name = docker_name(ref, "tag")
    for tag in new_tags:
        if not TAG.fullmatch(tag):
            raise DiskkitError(tag, "not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})")
    repo = open_repo(name, opts, "pull,push")
    data, media_type = get_manifest(repo, name.reference, ref)
    digest = sha256_digest(data)
    for tag in new_tags:
        put = repo.registry.request("PUT", f"/v2/{name.repository}/manifests/{tag}", repo.scope, headers={"Content-Type": media_type}, body=data, what="PUT manifest")
        check_status(put, (201, 200, 202), repo.registry.host, f"PUT manifest {tag}")
        for stored in (put.headers.get("Docker-Content-Digest") or digest, tag_digest(repo, tag)):
            if stored != digest:
                raise RegistryError(f"{repo}:{tag}", f"registry stored {stored}, not the source's {digest}")
    return digest, list(new_tags)
