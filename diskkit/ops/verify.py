"""Check an image the way KubeVirt consumes it, and inspect what it holds."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.disk import diskheader, diskrules, payload, qemuimg
from diskkit.disk.containerdisk import (
    ANNOTATION_FORMAT,
    ANNOTATION_PATH,
    ANNOTATION_VIRTUAL_SIZE,
    locate,
    wanted,
)
from diskkit.errors import DiskkitError, Exit, RangesRefused
from diskkit.layers import lazytoc
from diskkit.layers.imagefs import Spooled, extract_one, walk
from diskkit.layers.lazycheck import MemberCheck
from diskkit.layers.lazyinflate import MemberInflater
from diskkit.oci import artifact
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, Image, Platform, parse_json
from diskkit.oci.mediatypes import layer_compression
from diskkit.oci.reference import parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.transports import open_source
from diskkit.transports.base import Source


@dataclass
class DiskFacts:
    path: str | None = None
    format: str | None = None
    virtual_size: int | None = None
    size: int | None = None
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None

    def to_json(self) -> dict:
        out = {
            "path": self.path,
            "format": self.format,
            "virtualSize": self.virtual_size,
            "size": self.size,
            "uid": self.uid,
            "gid": self.gid,
            "mode": f"{self.mode:04o}" if self.mode is not None else None,
        }
        return out


@dataclass
class Report:
    reference: str
    image: Image | None = None
    disk: DiskFacts = field(default_factory=DiskFacts)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what KubeVirt would do differently, short of refusing
    unread: int | None = None  # the exit status of why the image could not be read, if it could not

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        """Exit.VERIFY_FAILED for a problem with the image; a missing image, refused credentials or an
        unreachable registry keep their own status, so a script can tell them apart."""
        if self.ok:
            return Exit.OK
        return self.unread if self.unread not in (None, Exit.FAILED) else Exit.VERIFY_FAILED


def scan(ref: str, platform: Platform | None, path: str | None, spool: Path, head_limit: int | None, registry: RegistryOptions | None):
    """Stream the image once: the tree, where the disk is, and the disk spooled (sparse) into `spool`.

    With `head_limit` only that many bytes of each candidate are kept (enough to read a header).
    """
    with open_source(ref, registry) as source:
        image = source.image(platform)
        if path is None and head_limit:
            path = (image.manifest.get("annotations") or {}).get(ANNOTATION_PATH)
        return (image, *scan_image(source, image, path, spool, head_limit))


def scan_image(source: Source, image: Image, path: str | None, spool: Path, head_limit: int | None = None, allow_root_file: bool = False,
               kept: dict[str, Spooled] | None = None, keep: frozenset[str] = frozenset(), taps: dict | None = None,
               inflate_lazy: bool = False, tocs: dict[int, lazytoc.Toc | None] | None = None):
    """The tree, the located disk and its spooled file (None when it is missing or only partly kept).

    With `kept`, the files at `keep` are spooled too and put there; `taps` as imagefs.walk's. An
    artifact boots only through an image volume, so the image volume's rule (a lone file at the root)
    applies to it whatever `allow_root_file` says. With `inflate_lazy`, lazy v2 layers are inflated
    on every core, their TOCs read first and trusted for nothing the blob digest and diffID do not
    also pin (a TOC that cannot be read, or that does not describe its blob, is refused); `tocs` are
    those the caller already read, by layer index, not asked of the source again."""
    allow_root_file = allow_root_file or is_artifact(image)
    disk_candidate = wanted(path, allow_root_file)
    want = disk_candidate if not keep else (lambda p: disk_candidate(p) or p in keep)
    inflaters = lazy_inflaters(source, image, tocs or {}) if inflate_lazy else None
    tree, spooled = walk(source, image, want, spool, head_limit, taps=taps, inflaters=inflaters)
    if kept is not None:
        kept.update({p: spooled[p] for p in keep if p in spooled and spooled[p].complete})
    found = locate(tree, path, allow_root_file=allow_root_file)
    disk_file = None
    if found.node is not None:
        hit = spooled.get(found.node.path)
        if hit is not None and hit.node is found.node:
            disk_file = hit.path
        elif head_limit is None:
            disk_file = spool / "disk"
            extract_one(source, image, found.node, disk_file)
    return tree, found, disk_file


def lazy_inflaters(source: Source, image: Image, known: dict[int, lazytoc.Toc | None] | None = None) -> dict:
    """For each lazy v2 gzip layer, what inflates its members on every core (imagefs.walk's `inflaters`);
    a TOC that cannot be read where its annotations say is refused, a registry failure raised as it is."""
    inflaters = {}
    # From a registry the TOC is read with a range that is refused, not read up to, when the
    # registry ignores Range: that layer then inflates on one core, its blob fetched once.
    reader = source
    if source.remote:
        from diskkit.registry.ranges import RangeReader

        reader = RangeReader(source.registry, source.name.repository)
    for index, layer in enumerate(image.layers):
        if layer_compression(layer.media_type) != "gzip":
            continue
        where = f"{image.where}: {_where(image, index)}"
        try:
            toc = (known or {}).get(index) or read_toc(reader, layer, where)
        except RangesRefused:
            continue
        if toc is not None and toc.members is not None:
            inflaters[index] = lambda raw, toc=toc, where=where: MemberInflater(raw, toc, where)
    return inflaters


def verify(ref: str, path: str | None = None, platform: Platform | None = None, registry: RegistryOptions | None = None) -> Report:
    """Every rule KubeVirt applies before booting, plus blob digests; problems are listed, not raised."""
    report = Report(ref)
    spool = Path(tempfile.mkdtemp(prefix="diskkit-verify-"))
    try:
        try:
            kept: dict[str, Spooled] = {}
            with open_source(ref, registry) as source:
                image = source.image(platform)
                tocs = stored_tocs(source, image, report.problems)
                # Each chunk's member is checked against its pin as the blob streams through: one read of it.
                taps = {i: (lambda raw, toc=toc, i=i: MemberCheck(raw, toc, _where(image, i)))
                        for i, toc in tocs.items() if toc is not None and toc.member_digests is not None}
                keep = frozenset({lazytoc.TOC_MEMBER}.union(*(dict(t.files) for t in tocs.values() if t is not None)))
                tree, found, disk_file = scan_image(source, image, path, spool, kept=kept, keep=keep, taps=taps)
        except DiskkitError as exc:
            # Problems are printed after the reference already: naming it again says nothing.
            report.problems.append(exc.rule if exc.subject in _names(ref) else exc.line())
            report.unread = exc.exit_code
            return report
        report.image = image
        report.problems += tree.findings + found.problems
        report.notes += artifact_notes(image, found)
        fill(report.disk, found)
        if disk_file is not None:
            report.problems += disk_problems(disk_file, found.shown, report.disk)
            report.problems += toc_problems(image, tocs, kept, disk_file, found.node.path)
        return report
    finally:
        shutil.rmtree(spool, ignore_errors=True)


def verify_all(ref: str, path: str | None = None, registry: RegistryOptions | None = None) -> list[tuple[Platform | None, Report]]:
    """`verify` of every platform an index lists (entries without a platform, such as attestations, are
    not images to boot); a single image is verified as it is. An entry whose config names another
    platform than the index does is a problem: a node would pull it for the wrong machine."""
    with open_source(ref, registry) as source:
        data, media, _ = source.top_manifest()
        obj = parse_json(data, source.where)
    if (media or obj.get("mediaType")) not in mt.INDEXES and "manifests" not in obj:
        return [(None, verify(ref, path, None, registry))]
    platforms = []
    for entry in obj.get("manifests") or []:
        spec = entry.get("platform") if isinstance(entry, dict) else None
        if isinstance(spec, dict) and spec.get("os") and spec.get("architecture"):
            platforms.append(Platform(str(spec["os"]), str(spec["architecture"]), spec.get("variant") or None))
    if not platforms:
        report = Report(ref)
        report.problems.append("the index lists no platform image")
        return [(None, report)]
    out = []
    for plat in platforms:
        report = verify(ref, path, plat, registry)
        if report.image is not None:
            config = report.image.config
            said = Platform(str(config.get("os")), str(config.get("architecture")), config.get("variant") or None)
            if (said.os, said.architecture) != (plat.os, plat.architecture) or (plat.variant and said.variant and said.variant != plat.variant):
                report.problems.append(f"the index lists {report.image.digest} as {plat}, its config says {said}")
        out.append((plat, report))
    return out


def is_artifact(image: Image) -> bool:
    return artifact.is_artifact(image.manifest, image.config_descriptor.media_type)


def artifact_notes(image: Image, found) -> list[str]:
    """A compressed file layer holding the disk: accepted here, but CRI-O mounts its bytes as they are."""
    if found.node is None:
        return []
    layer = image.layers[found.node.layer]
    as_file = artifact.file_layer(image.manifest, image.config_descriptor.media_type, layer.media_type, layer.annotations)
    if as_file is None or as_file.compression == "none":
        return []
    return [f"{found.shown} is {as_file.compression}-compressed in its layer ({layer.media_type}): CRI-O puts an artifact's blob "
            "in the image volume as it is, so KubeVirt would boot the compressed bytes; diskkit and launcher decompress it"]


def _where(image: Image, index: int) -> str:
    return f"layer {index} ({image.layers[index].digest[:19]})"


def stored_tocs(source: Source, image: Image, problems: list[str]) -> dict[int, lazytoc.Toc | None]:
    """The TOCs of lazy layers, read where their annotations point in the blob (as a lazy reader
    reads them) before the blob streams; None (and a problem) for one that cannot be read there."""
    tocs: dict[int, lazytoc.Toc | None] = {}
    for index, layer in enumerate(image.layers):
        try:
            toc = read_toc(source, layer, _where(image, index))
            if toc is not None:
                tocs[index] = toc
        except DiskkitError as exc:
            problems.append(exc.line())
            tocs[index] = None
    return tocs


def read_toc(source: Source, layer: Descriptor, where: str) -> lazytoc.Toc | None:
    """A layer's lazy TOC, read (one range of the blob) and checked where its annotations say; None without one."""
    loc = lazytoc.location(layer, where)
    if loc is None:
        return None
    version = lazytoc.version_for(layer.media_type)
    return lazytoc.parse(lazytoc.read_stored(source.read_range(layer, loc.offset, loc.size), version, where), loc, where, version)


def toc_problems(image: Image, tocs: dict[int, lazytoc.Toc | None], kept: dict[str, Spooled], disk_file: Path, member: str) -> list[str]:
    """A lazy image's TOC against the layer as unpacked: pinned by the annotations, and describing
    the disk and the files that are really there (a lazy reader trusts it for every byte it serves).
    Member pins were checked as the blob streamed (MemberCheck); uncompressed chunk pins are checked here."""
    problems: list[str] = []
    size = disk_file.stat().st_size
    for index, layer in enumerate(image.layers):
        where = _where(image, index)
        if index in tocs and tocs[index] is None:
            continue  # its TOC could not be read where the annotations say: reported already
        try:
            loc = lazytoc.location(layer, where)
            if loc is None:
                continue
            toc_file = kept.get(lazytoc.TOC_MEMBER)
            if toc_file is None:
                problems.append(f"{where}: its annotations pin a lazy TOC, but the layer holds no /{lazytoc.TOC_MEMBER}")
                continue
            toc = lazytoc.parse(toc_file.path.read_bytes(), loc, where, lazytoc.version_for(layer.media_type))
        except DiskkitError as exc:
            problems.append(exc.line())
            continue
        if (toc.disk, toc.size) != (member, size):
            problems.append(f"{where}: the lazy TOC describes /{toc.disk} ({toc.size} bytes), not the disk /{member} ({size} bytes)")
            continue
        with open(disk_file, "rb") as f:
            for chunk, digest in enumerate(toc.chunks or ()):
                if hashlib.sha256(f.read(toc.chunk_size)).hexdigest() != digest:
                    problems.append(f"{where}: the lazy TOC's digest of chunk {chunk} does not match /{member}")
                    break
        problems += _file_problems(toc, index, kept, where)
    return problems


def _file_problems(toc: lazytoc.Toc, index: int, kept: dict[str, Spooled], where: str) -> list[str]:
    """The TOC's `files` (kernelBoot's kernel and initrd, which a lazy reader takes on their word)."""
    problems = []
    for path, digest in toc.files:
        spooled = kept.get(path)
        if spooled is None or spooled.node.layer != index:
            problems.append(f"{where}: the lazy TOC's files list /{path}, which is not a regular file of this layer")
            continue
        with open(spooled.path, "rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if got != digest:
            problems.append(f"{where}: /{path} does not match its digest in the lazy TOC's files")
    return problems


def _names(ref: str) -> set[str]:
    """The ways an error line may already name `ref`."""
    try:
        return {ref, str(parse_ref(ref))}
    except DiskkitError:
        return {ref}


def fill(disk: DiskFacts, found) -> None:
    disk.path = found.shown
    if found.node is not None:
        node = found.node
        disk.size, disk.uid, disk.gid, disk.mode = node.size, node.uid, node.gid, node.mode & 0o7777


def disk_problems(disk_file: Path, shown: str, disk: DiskFacts) -> list[str]:
    """KubeVirt's checks of the disk file itself (format, backing file, data file, consistency); fills `disk`."""
    with open(disk_file, "rb") as f:
        head = f.read(diskheader.HEADER_BYTES)
    header = diskheader.parse(head)
    checking = None
    if header is not None:
        disk.format, disk.virtual_size = "qcow2", header.virtual_size
        unsafe = diskheader.safety_violations(header)
        if unsafe:  # never hand qemu-img an image that names host files
            return [f"{shown}: {p}" for p in unsafe]
        # As examine_disk: the check runs beside info (each a cold start of qemu-img), judged only if info agrees.
        checking = qemuimg.start_check(disk_file, "qcow2")
    else:
        # qemu-img calls anything it does not know raw, so a packaged .xz or YAML would boot as a blank disk
        not_disk = payload_problem(head, disk_file.stat().st_size)
        if not_disk:
            return [f"{shown}: {not_disk}"]
    try:
        try:
            info = qemuimg.info(disk_file)
        except DiskkitError as exc:
            return [f"{shown}: {exc.rule}"]
        disk.format, disk.virtual_size = info.format, info.virtual_size
        problems = [f"{shown}: {p}" for p in diskrules.violations(info)]
        if not problems and info.format == "qcow2":
            try:
                qemuimg.check(disk_file, "qcow2", checking)
            except DiskkitError as exc:
                problems.append(f"{shown}: {exc.rule}")
            checking = None
        return problems
    finally:
        if checking is not None:
            checking.kill()
            checking.communicate()


def payload_problem(head: bytes, size: int) -> str | None:
    """What a file in /disk/ that is not a disk is, and what to do about it."""
    kind = payload.classify(head[: payload.HEAD_BYTES], size)
    if kind in payload.COMPRESSIONS or kind == "tar":
        what = "a tar archive" if kind == "tar" else f"{kind}-compressed data"
        return f"is {what}, not a disk: KubeVirt would boot it as a raw disk of those bytes; build the image from the file itself (diskkit build unwraps {kind})"
    return payload.refusal(kind, head, size)


def inspect(ref: str, platform: Platform | None = None, registry: RegistryOptions | None = None, path: str | None = None) -> Report:
    """Manifest, config, layers and the disk's facts.

    Local images are read through (only the disk's first bytes are kept); registry images are
    described from the manifest and config alone, without pulling layers, using the disk
    annotations diskkit writes.
    """
    report = Report(ref)
    if parse_ref(ref).transport == "docker":
        with open_source(ref, registry) as source:
            report.image = source.image(platform)
        notes = report.image.manifest.get("annotations") or {}
        report.disk.path = notes.get(ANNOTATION_PATH)
        report.disk.format = notes.get(ANNOTATION_FORMAT)
        size = notes.get(ANNOTATION_VIRTUAL_SIZE)
        report.disk.virtual_size = int(size) if size and size.isdigit() else None
        return report
    if path is None:
        # An image built with --path says where its disk is; looking only in /disk would call it broken.
        with open_source(ref, registry) as source:
            path = (source.image(platform).manifest.get("annotations") or {}).get(ANNOTATION_PATH)
    spool = Path(tempfile.mkdtemp(prefix="diskkit-inspect-"))
    try:
        image, tree, found, head_file = scan(ref, platform, path, spool, diskheader.HEADER_BYTES, registry)
        report.image = image
        report.problems += tree.findings + found.problems
        fill(report.disk, found)
        if head_file is not None:
            head = head_file.read_bytes()
            report.disk.format = diskheader.probe_format(head)
            header = diskheader.parse(head)
            report.disk.virtual_size = header.virtual_size if header else (report.disk.size if report.disk.format == "raw" else None)
            not_disk = payload_problem(head, report.disk.size or len(head)) if report.disk.format == "raw" else None
            if not_disk:
                report.problems.append(f"{found.shown}: {not_disk}")
        return report
    finally:
        shutil.rmtree(spool, ignore_errors=True)


def describe(report: Report) -> dict:
    image = report.image
    out: dict = {"reference": report.reference}
    if image is not None:
        config = image.config
        out.update(
            {
                "digest": image.digest,
                "mediaType": image.media_type,
                "os": config.get("os"),
                "architecture": config.get("architecture"),
                "created": config.get("created"),
                "labels": (config.get("config") or {}).get("Labels") or {},
                "env": (config.get("config") or {}).get("Env") or [],
                "annotations": image.manifest.get("annotations") or {},
                "config": image.config_descriptor.to_json(),
                "layers": [
                    {**layer.to_json(), "diffID": diff}
                    for layer, diff in zip(image.layers, image.diff_ids + [None] * len(image.layers))
                ],
            }
        )
        if image.manifest.get("artifactType"):
            out["artifactType"] = image.manifest["artifactType"]
    out["disk"] = report.disk.to_json()
    out["problems"] = report.problems
    if report.notes:
        out["notes"] = report.notes
    return out


