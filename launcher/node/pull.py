"""Pull a containerDisk into the node cache: one streaming pass, verified, sparse, checked before use.

Layers are read in order with whiteouts applied and only the candidate files spooled (no root
filesystem is unpacked); the disk is located with KubeVirt's rules, checked with qemu-img under
limits, then renamed into the cache. A second pull of the same image finds it there.

A lazy layer whose chunks the node partly holds already (any cached disk, any image) is assembled
from those and range requests for the rest (launcher.node.deltapull), then walked and checked as if
downloaded. Every disk installed is recorded in the node's chunk index (launcher.chunks), by the
content hashes its layer's TOC names (checked chunk by chunk when it was assembled; otherwise only a
hint, as every reader hashes what it reads) and, when its TOC is older than content-defined chunks or
it has none, by hashing the disk once as new TOCs cut it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from diskkit.disk.containerdisk import path_problem
from diskkit.errors import DiskkitError, NoSpace, ResumeFailed
from diskkit.layers import lazytoc
from diskkit.oci.image import Platform, sha256_digest
from diskkit.oci.reference import parse_ref
from diskkit.ops.verify import DiskFacts, disk_problems, scan_image
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions
from diskkit.registry.partial import abandoned
from diskkit.registry.ranges import RangesRefused
from diskkit.transports.remote import RemoteSource
from launcher.chunks.index import CHUNKS_FILE, ChunkIndex, Record, of_toc, records_for, reuse_allowed
from launcher.node import deltapull
from launcher.node.admission import CachedImage, access_of, admit, admitted
from launcher.node.cache import Cache, key

POLICIES = ("Always", "IfNotPresent", "Never")
# Tags this process resolved at the registry (shown name, platform): a second volume of the same
# image is not "cached". Held in memory, not by a record's clock, which a second process started
# within the same second would share.
_RESOLVED_HERE: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Pulled:
    path: Path  # the file in the cache: shared, read-only, never written by a VM
    format: str | None  # "raw" or "qcow2" for disks; None for plain files (kernels, initrds)
    virtual_size: int | None
    image: str
    digest: str  # manifest digest
    layer: str
    member: str
    fetched: int = 0  # layer bytes this pull asked the registry for (0: found in the cache, or a local transport)
    reused: int = 0  # disk bytes not fetched because the node held their chunks (deltapull)

    def to_json(self) -> dict:
        out = asdict(self)
        out["path"] = str(self.path)
        return out


def default_policy(ref: str) -> str:
    """Kubernetes' rule, which KubeVirt follows: `Always` for :latest or no tag, else `IfNotPresent`."""
    parsed = parse_ref(ref)
    if parsed.transport != "docker" or parsed.name is None or parsed.name.digest:
        return "IfNotPresent"
    return "Always" if parsed.name.tag in (None, "latest") else "IfNotPresent"


def pull(
    cache: Cache,
    ref: str,
    path: str | None = None,
    platform: Platform | None = None,
    registry: RegistryOptions | None = None,
    policy: str | None = None,
    disk: bool = True,
    accept=None,
    reporter: Reporter | None = None,
) -> Pulled:
    """The cached disk (or, with disk=False, plain file) that `ref` holds at `path` (default: /disk);
    `accept(config)` may refuse the image by its config before any layer is read; `reporter` shows
    the chunks' progress and what was fetched and reused."""
    reporter = reporter or Reporter()
    if path is not None and (problem := path_problem(path)):
        raise DiskkitError(f"{ref}: path {path}", problem)
    policy = policy or default_policy(ref)
    if policy not in POLICIES:
        raise DiskkitError(ref, f"imagePullPolicy {policy!r} is not one of {', '.join(POLICIES)}")
    shown = str(parse_ref(ref))
    hit = cached(cache, ref, path, platform, policy, disk, registry)
    if hit:
        _say_cached(ref, platform, hit, policy, reporter)
        return hit
    if policy == "Never" and parse_ref(ref).transport == "docker":
        raise DiskkitError(shown, "container image is not present with pull policy of Never")

    with admitted(shown, registry, platform, cache) as source:  # the policy first: before any layer is read
        if isinstance(source, RemoteSource):
            source.partial_dir = cache.partial_dir  # a pull killed half way resumes from what it had
        image = source.image(platform)
        if accept is not None:
            accept(image.config)
        ref_key = image_key(image.digest, path, platform, disk)
        with cache.lock(ref_key):
            hit = _cached(cache, ref_key, shown)
            if hit is None:
                try:
                    hit = _extract(cache, source, image, shown, path, disk, ref_key, reporter)
                except NoSpace as exc:
                    # The bytes kept for a resume are what filled the filesystem: they go too, and the
                    # user is told what to do rather than that a layer is broken.
                    for leftover in abandoned(cache.partial_dir):
                        leftover.unlink(missing_ok=True)
                    raise NoSpace(exc.subject, f"{exc.rule} to the cache {cache.root}; nothing was kept: "
                                                "free space there (launcher gc) and pull again") from None
                except ResumeFailed:
                    # The kept bytes are gone with the failure: once more, every byte from the registry.
                    hit = _extract(cache, source, image, shown, path, disk, ref_key, reporter)
        remember(cache, shown, platform, image, source)
    return hit


def cached_config(cache: Cache, pulled: Pulled) -> dict | None:
    """The config of the image a pull resolved to, from the manifest and config it remembered."""
    try:
        manifest = json.loads(cache.blob_path(pulled.digest).read_bytes())
        config = json.loads(cache.blob_path(manifest["config"]["digest"]).read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return config if isinstance(config, dict) else None


def image_key(digest: str, path: str | None, platform: Platform | None, disk: bool = True) -> str:
    """The key of the ref record for (manifest, path, platform): what a pull resolved to."""
    return key(digest, path or "", "disk" if disk else "file", str(platform or Platform.host()))


def present(cache: Cache, ref: str, path: str | None, platform: Platform | None, policy: str, disk: bool = True) -> tuple[Pulled, CachedImage] | None:
    """What the cache holds for `ref` under `policy` without asking the registry (IfNotPresent,
    Never), and the image it came from; else None. Not yet admitted: `cached` is what may be used."""
    # Local layouts and archives are re-read every time: resolving them costs nothing.
    if policy == "Always" or parse_ref(ref).transport != "docker":
        return None
    shown = str(parse_ref(ref))
    record_path = cache.tag_path(key(shown, str(platform or Platform.host())))
    known = cache.read_json(record_path)
    hit = _cached(cache, image_key(known["digest"], path, platform, disk), shown) if known else None
    if hit is None:
        return None
    try:
        image = CachedImage(cache, known, record_path)
    except (DiskkitError, KeyError, TypeError):
        return None  # a record this launcher did not write: pulled again
    return (hit, image) if image.present else None


def _say_cached(ref: str, platform: Platform | None, hit: Pulled, policy: str, reporter: Reporter) -> None:
    """A tag answered from the node's record of it, not the registry's, is said with its digest: the
    tag may have moved since (KubeVirt's IfNotPresent, as the kubelet keeps it). Not for a digest, and
    not for a tag this very process resolved (a second volume of the same image)."""
    if parse_ref(ref).name.digest is not None:
        return
    if (hit.image, str(platform or Platform.host())) in _RESOLVED_HERE:
        return
    reporter.note(f"{hit.image}: cached {hit.digest} (imagePullPolicy {policy}); imagePullPolicy: Always or --pull-policy Always"
                  " asks the registry where the tag is now")


def cached(cache: Cache, ref: str, path: str | None, platform: Platform | None, policy: str, disk: bool = True,
           registry: RegistryOptions | None = None) -> Pulled | None:
    """The cache's answer under `policy` without asking the registry for the image (IfNotPresent,
    Never), once the policy in force accepts it (launcher.node.admission); else None."""
    found = present(cache, ref, path, platform, policy, disk)
    if found is None:
        return None
    hit, image = found
    admit(image, registry, platform, cache)
    return hit


def remember(cache: Cache, shown: str, platform: Platform | None, image, source) -> None:
    """Manifests, config and what the reference resolved to (the manifest or index, under the name
    the policy scopes it by, and how the read got in), for IfNotPresent, the policy and the
    credentials on a cache hit (launcher.node.admission) and `launcher ls`."""
    cache.put_blob(image.digest, image.manifest_bytes)
    cache.put_blob(image.config_descriptor.digest, image.config_bytes)
    data, media, desc = source.manifest_descriptors()
    top = desc.digest if desc else sha256_digest(data)
    cache.put_blob(top, data)
    platform_text = str(platform or Platform.host())
    _RESOLVED_HERE.add((shown, platform_text))
    # a short name is scoped by the candidate that had it (diskkit.signing.trust)
    name = str(replace(source.ref, name=source.requested, short=None)) if isinstance(source, RemoteSource) else shown
    cache.write_json(cache.tag_path(key(shown, platform_text)), {"image": shown, "platform": platform_text, "digest": image.digest,
                                                                "top": top, "topMediaType": media, "name": name, "access": access_of(source)})


def _cached(cache: Cache, ref_key: str, shown: str) -> Pulled | None:
    """The disk a pull of this manifest installed, named `shown`: the reference asked for now, not the
    one (another tag of the same digest, maybe) whose pull installed it."""
    record = cache.read_json(cache.ref_path(ref_key))
    if not record or not Path(record["path"]).is_file():
        return None
    with contextlib.suppress(OSError):
        os.utime(Path(record["path"]).parent / "meta.json")  # last use, for gc --max-size
    return Pulled(**{**record, "path": Path(record["path"]), "image": shown})


def _extract(cache: Cache, source, image, shown: str, path: str | None, disk: bool, ref_key: str, reporter: Reporter, by_chunks: bool = True) -> Pulled:
    cache.reclaim_staging()  # what killed pulls left behind: this one may need the space
    transfer = deltapull.Transfer()
    index = ChunkIndex(cache)
    plans, tocs = {}, {}
    try:
        # The TOCs are read ahead (one range request each) only when the node has chunks to offer.
        if by_chunks and isinstance(source, RemoteSource) and reuse_allowed() and not index.empty():
            tocs = deltapull.read_tocs(source, image, transfer)
            plans = deltapull.plan(source, image, tocs, index, transfer)
    except sqlite3.Error:  # the index is a hint: without it, the pull is a whole one
        plans = {}
    walked_source, walked_image = source, image
    if plans:
        walked_source = deltapull.DeltaSource(source, plans, index, cache, transfer, reporter)
        walked_image = deltapull.assembled_image(image, plans)
    elif isinstance(source, RemoteSource):
        transfer.fetched += sum(layer.size for layer in image.layers)
    for why in transfer.whole:
        reporter.event({"event": "pulled-whole", "image": shown, "reason": why})
    with cache.staging() as spool:
        kept: dict = {}
        # The ImageVolume rule (a lone file at the root) only applies when no path was given.
        try:
            tree, found, staged = scan_image(walked_source, walked_image, path, spool, allow_root_file=path is None,
                                             kept=kept, keep=frozenset({lazytoc.TOC_MEMBER}),
                                             inflate_lazy=by_chunks and not transfer.ranges_refused,  # no TOC asked again of a registry that ignores Range
                                             tocs=tocs)  # nor one the delta plan read
        except RangesRefused:
            return _extract(cache, source, image, shown, path, disk, ref_key, reporter, by_chunks=False)
        # The rules `diskkit verify` applies, UID 107's access included: KubeVirt never chowns the
        # file, so qemu would fail on it with Permission denied in a real virt-launcher.
        blocking = tree.findings + found.problems
        if found.node is None or staged is None or blocking:
            raise DiskkitError(shown, "; ".join(blocking) or f"{found.shown}: not found in the image")
        facts = DiskFacts()
        if disk:
            problems = disk_problems(staged, found.shown, facts)
            if problems:
                raise DiskkitError(shown, "; ".join(problems))
        layer = image.layers[found.node.layer].digest
        meta = {"layer": layer, "member": found.node.path, "format": facts.format, "virtual_size": facts.virtual_size}
        records = _chunk_records(_unpacked_toc(image, found.node.layer, kept.get(lazytoc.TOC_MEMBER)), found.node.path, staged) if disk else []
        extra = {CHUNKS_FILE: records[0].render()} if records else {}
        final = cache.install_disk(staged, layer, found.node.path, meta, extra)
    if records:
        with contextlib.suppress(sqlite3.Error):
            index.add_file(str(final.relative_to(cache.root)), *records)
    pulled = Pulled(final, facts.format, facts.virtual_size, shown, image.digest, layer, found.node.path, transfer.fetched, transfer.reused)
    record = pulled.to_json()
    for counted in ("fetched", "reused"):  # this pull's, not what a later hit of the record costs
        record.pop(counted)
    cache.write_json(cache.ref_path(ref_key), record)
    if transfer.assembled:
        reporter.note(f"{shown}: {transfer.fetched} bytes fetched, {transfer.reused} bytes of the disk reused from the node")
    reporter.event({"event": "pulled", "image": shown, "fetched": transfer.fetched, "reused": transfer.reused})
    return pulled


def _unpacked_toc(image, layer: int, spooled) -> lazytoc.Toc | None:
    """The lazy TOC the disk's layer holds, as the walk unpacked it (its diffID checked), pinned by
    the layer's annotations; None when there is none or it is not the one they pin."""
    desc = image.layers[layer]
    if spooled is None or spooled.node.layer != layer:
        return None
    try:
        loc = lazytoc.location(desc, image.where)
        return lazytoc.parse(spooled.path.read_bytes(), loc, image.where, lazytoc.version_for(desc.media_type)) if loc else None
    except (DiskkitError, OSError):
        return None


def _chunk_records(toc: lazytoc.Toc | None, member: str, staged: Path) -> list[Record]:
    """What to index the installed disk by (launcher.chunks.index.records_for): its TOC's chunks when
    the TOC describes this very file, and the disk cut and hashed as new TOCs cut it where they differ."""
    size = staged.stat().st_size
    if size == 0:
        return []
    described = toc is not None and (toc.disk, toc.size) == (member, size)
    return records_for(staged, of_toc(toc) if described else None)
