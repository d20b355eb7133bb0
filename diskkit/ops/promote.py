"""Promote a verified image: copy it by digest to a repository (the same registry or another) and put
it under release tags there, never narrowing an index to one platform, and prove afterwards that
every tag names exactly the digest that was verified.

A CI pipeline tests an image by digest and then publishes that digest; a promotion that pushed
anything else (an index narrowed to the host's platform, a manifest rewritten on the way) would
publish bytes nobody tested, so anything but the source's own bytes is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from diskkit.errors import DiskkitError, RegistryError
from diskkit.oci.reference import DockerName
from diskkit.ops.copy import copy_image
from diskkit.ops.tags import TAG, add_tags, docker_name, open_repo, tag_digest
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions


@dataclass
class Promotion:
    source: str
    digest: str
    repository: str
    tags: list[str]
    blobs: dict[str, str]  # digest -> uploaded | skipped | mounted

    def to_json(self) -> dict:
        return {"source": self.source, "digest": self.digest, "repository": self.repository, "tags": self.tags,
                "references": [f"{self.repository}:{t}" for t in self.tags], "blobs": self.blobs}


def split_tags(values: tuple[str, ...]) -> list[str]:
    """`--tags a,b --tags c` as [a, b, c]: each checked against distribution's tag grammar, none twice."""
    tags = [t.strip() for value in values for t in value.split(",")]
    for tag in tags:
        if not TAG.fullmatch(tag):
            raise DiskkitError(f"--tags {tag}" if tag else "--tags", "not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})")
    twice = sorted({t for t in tags if tags.count(t) > 1})
    if twice:
        raise DiskkitError(f"--tags {twice[0]}", "named twice")
    if not tags:
        raise DiskkitError("--tags", "give at least one tag")
    return tags


def destination_repository(dest: str) -> DockerName:
    """DEST as a repository: the tags come from --tags, so a tag or digest in DEST is refused."""
    name = docker_name(dest, "promote")
    last = dest.rpartition("/")[2]
    if name.digest or ":" in last:
        raise DiskkitError(dest, "give the destination as a repository without a tag or digest (the tags are --tags)")
    return DockerName(name.registry, name.repository)


def promote(src: str, dest: str, tags: list[str], src_opts: RegistryOptions, dest_opts: RegistryOptions, reporter: Reporter) -> Promotion:
    source = docker_name(src, "promote")
    if not source.digest:
        raise DiskkitError(src, "promote copies a digest: give the source as REPOSITORY@sha256:... (the digest that was tested)")
    repository = destination_repository(dest)
    shown = f"{repository.registry}/{repository.repository}"
    # Blobs, then the index's images by digest, then the manifest under the first tag: the bytes
    # unchanged, or refused (preserve_digests) rather than rewritten.
    copied = copy_image(f"docker://{source}", f"docker://{shown}:{tags[0]}", src_opts, reporter, multi_arch="all",
                        dest_opts=dest_opts, preserve_digests=True)
    if copied.digest != source.digest:
        raise RegistryError(f"{shown}:{tags[0]}", f"stored as {copied.digest}, not the source's {source.digest}")
    if tags[1:]:
        add_tags(f"docker://{shown}@{source.digest}", tuple(tags[1:]), dest_opts)
    repo = open_repo(repository, dest_opts, "pull")
    for tag in tags:
        # Read back last, every tag: a registry that stored something else, or a tag another job
        # moved meanwhile, fails the promotion instead of being reported as done.
        found = tag_digest(repo, tag)
        if found != source.digest:
            raise RegistryError(f"{shown}:{tag}", f"points at {found or 'nothing'}, not the promoted {source.digest}")
    return Promotion(str(source), source.digest, shown, tags, copied.blobs)
