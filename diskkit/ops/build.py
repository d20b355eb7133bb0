"""`diskkit build`: a disk file in, a scratch-based containerDisk image out, in one streaming pass."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from diskkit.disk import diskheader, diskrules, payload, qemuimg
from diskkit.disk.containerdisk import (
    ANNOTATION_FORMAT,
    ANNOTATION_PATH,
    ANNOTATION_VIRTUAL_SIZE,
    path_problem,
)
from diskkit.errors import DiskkitError
from diskkit.layers import lazygzip, lazytoc
from diskkit.layers.layer import LayerResult, entries_for, write_layer
from diskkit.ops import artifactbuild, buildrecord, buildskip
from diskkit.ops.buildmeta import Metadata
from diskkit.oci.image import (
    Descriptor,
    Platform,
    canonical_json,
    make_config,
    make_index,
    make_manifest,
    rfc3339,
)
from diskkit.oci.mediatypes import (
    DOCKER_CONFIG,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    docker_layer,
    oci_layer,
)
from diskkit.oci.reference import parse_ref
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions
from diskkit.source import fetch
from diskkit.transports import open_destination
from diskkit.transports.base import with_restarts

DISK_FORMATS = ("keep", "qcow2", "raw")


@dataclass
class BuildOptions:
    source: str | Path | None  # a file, an http(s) URL, or "-" for stdin
    dest: str
    path: str | None = None
    kernel: tuple[str, Path] | None = None
    initrd: tuple[str, Path] | None = None
    compression: str = "gzip"
    level: int | None = None
    # Chunk TOC, so launchers boot it before it has arrived (gzip: TOC v2, none: TOC v1). None: v2
    # wherever it costs nothing (a gzip layer in an OCI manifest), a plain layer elsewhere.
    lazy: bool | None = None
    # How a lazy gzip layer's disk is cut: "content" (TOC v3: chunks keep their identity when an update
    # moves them), "fixed" (TOC v2: 1 MiB chunks, as launchers before v3 read). None: content.
    lazy_chunks: str | None = None
    disk_format: str = "keep"
    platform: Platform = field(default_factory=lambda: Platform("linux", "amd64"))
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    env: list[str] = field(default_factory=list)
    created: int = 0
    platforms: list[tuple[Platform, str | Path]] = field(default_factory=list)  # one source per platform, for an index
    also: list[str] = field(default_factory=list)  # more destinations (-t repeated), given the same image
    # Per-platform labels/env and annotations for each level (index, manifests, their descriptors).
    metadata: Metadata = field(default_factory=Metadata)
    artifact: bool = False  # an OCI 1.1 artifact: the disk as one file layer named by its title (diskkit.oci.artifact)
    checksum: str | None = None  # sha256:HEX or sha512:HEX the (single) input's bytes must hash to
    checksum_file: str | None = None  # a GNU or BSD checksum file (URL or path) listing each input by name


@dataclass
class BuildResult:
    reference: str
    digest: str
    media_type: str
    size: int
    layers: list[LayerResult]
    disk_path: str
    disk_format: str
    virtual_size: int
    images: list["BuildResult"] = field(default_factory=list)
    descriptor: Descriptor | None = None
    written: list[dict] = field(default_factory=list)  # every destination: {"reference", "digest", "status"}
    fetched: bool = True  # False: an unchanged pinned URL build answered from its record (diskkit.ops.buildskip)

    def to_json(self) -> dict:
        out = {
            "reference": self.reference,
            "digest": self.digest,
            "mediaType": self.media_type,
            "size": self.size,
            "layers": [
                {"digest": layer.digest, "size": layer.size, "diffID": layer.diff_id, "compression": layer.compression}
                for layer in self.layers
            ],
            "disk": {"path": self.disk_path, "format": self.disk_format, "virtualSize": self.virtual_size},
        }
        if self.written:
            out["destinations"] = self.written
        if self.images:
            out["manifests"] = [{"platform": i.descriptor.platform, **i.to_json()} for i in self.images]
        if not self.fetched:
            out["sourceFetched"] = False
        return out

    @classmethod
    def from_json(cls, obj: dict, fetched: bool = True) -> "BuildResult":
        """The result to_json wrote (a build record's): what an unchanged rebuild reports."""
        disk = obj["disk"]
        layers = [LayerResult(l["digest"], int(l["size"]), l["diffID"], l["compression"]) for l in obj["layers"]]
        images = [cls.from_json(m) for m in obj.get("manifests") or []]
        for image, m in zip(images, obj.get("manifests") or []):
            image.descriptor = Descriptor(image.media_type, image.digest, image.size, platform=m["platform"])
        return cls(obj["reference"], obj["digest"], obj["mediaType"], int(obj["size"]), layers, disk["path"], disk["format"],
                   int(disk["virtualSize"]), images, fetched=fetched)


def source_epoch() -> int:
    """SOURCE_DATE_EPOCH when set (reproducible-builds.org), else 0: the same input gives the same digest."""
    value = os.environ.get("SOURCE_DATE_EPOCH")
    if value is None or value == "":
        return 0
    if not value.isdigit():
        raise DiskkitError("SOURCE_DATE_EPOCH", f"must be a whole number of seconds, not {value!r}")
    return int(value)


def check_input_file(path: Path, what: str = "source disk") -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DiskkitError(path, f"{what} does not exist") from None
    except OSError as exc:
        raise DiskkitError(path, f"{what} cannot be read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise DiskkitError(path, f"{what} is a directory; give a disk image file")
    if not stat.S_ISREG(st.st_mode):
        raise DiskkitError(path, f"{what} is not a regular file")
    if st.st_size == 0:
        raise DiskkitError(path, f"{what} is empty (0 bytes)")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise DiskkitError(path, f"{what} cannot be read ({exc.strerror})") from None


def input_disk(src: str | Path, workdir: Path, note=None, checksum: str | None = None, checksum_file: str | None = None,
               registry: RegistryOptions | None = None, expected: list | None = None) -> payload.Unwrapped:
    """The disk an input holds (a file, an http(s) URL or `-` for stdin; decompressed or taken out
    of its archive into `workdir`), its bytes checked against the checksum given (or the
    `expected` fetch.expectations already read); text, executables and files too small to be
    disks refused."""
    registry = registry or RegistryOptions()
    if not fetch.is_stream(src):
        check_input_file(Path(src))
    if expected is None:
        expected = fetch.expectations(src, checksum, checksum_file, registry)
    if fetch.is_stream(src):
        return fetch.download(str(src), workdir, expected, registry, note)
    path = Path(src)
    if expected:
        fetch.check_file(path, expected)
    return payload.unwrap(path, workdir, note)


def examine_disk(path: Path) -> qemuimg.DiskInfo:
    """Everything we refuse before packaging: unreadable, empty, unsafe or corrupt disks."""
    check_input_file(path)
    with open(path, "rb") as f:
        head = f.read(diskheader.HEADER_BYTES)
    header = diskheader.parse(head)
    checking = None
    if header is not None:
        unsafe = diskheader.safety_violations(header)
        if unsafe:
            raise DiskkitError(path, f"{unsafe[0]}; containerDisk images must be self-contained")
        # A qcow2 header with nothing outside the file: the check runs beside info (a cold start of
        # each is ~20 ms), and is judged only if info agrees.
        checking = qemuimg.start_check(path, "qcow2")
    try:
        info = qemuimg.info(path)
        if info.format not in qemuimg.INPUT_FORMATS:
            raise DiskkitError(path, f"input format {info.format} is not supported (use one of {', '.join(qemuimg.INPUT_FORMATS)})")
        unsafe = [v for v in diskrules.violations(info) if not v.startswith("unsupported image format")]
        if unsafe:
            raise DiskkitError(path, f"{unsafe[0]}; containerDisk images must be self-contained")
        if info.format == "qcow2":
            qemuimg.check(path, "qcow2", checking)
            checking = None
    finally:
        if checking is not None:
            checking.kill()
            checking.communicate()
    return info


def examine_input(disk: payload.Unwrapped, given: str | Path) -> qemuimg.DiskInfo:
    """examine_disk of what an input held, its refusals naming the input (the URL, stdin, the
    compressed file) instead of the temporary file it was unwrapped into."""
    try:
        return examine_disk(disk.path)
    except DiskkitError as exc:
        if disk.path == Path(given) or exc.subject != str(disk.path):
            raise
        raise DiskkitError(fetch.shown(given), exc.rule) from None


def split_artifact(value: str, default_path: str, flag: str) -> tuple[str, Path]:
    """`--kernel FILE` or `--kernel /path/in/image=FILE`."""
    image_path, sep, local = value.partition("=")
    if not sep:
        image_path, local = default_path, value
    problem = path_problem(image_path)
    if problem:
        raise DiskkitError(f"{flag} {image_path}", problem)
    if image_path.endswith("/"):
        raise DiskkitError(f"{flag} {image_path}", "names a directory; give the file's path in the image")
    return image_path, Path(local)


def build(opts: BuildOptions, reporter: Reporter, registry: RegistryOptions | None = None, before_manifest=None) -> BuildResult:
    """Build one image, or with `opts.platforms` one image per platform under an OCI index; with
    `opts.also`, give the same image to every further destination after the first.
    `before_manifest(ref)` gives the hook (a signer) that sees each manifest's digest before it is
    stored at that destination, or None."""
    dest_ref = parse_ref(opts.dest)
    others = check_destinations([dest_ref, *(parse_ref(d) for d in opts.also)], registry or RegistryOptions())[1:]
    hook = before_manifest or (lambda ref: None)
    result = _build(opts, dest_ref, reporter, registry, hook(dest_ref))
    if not others:
        return result
    result.written.append({"reference": str(dest_ref), "digest": result.digest, "status": "pushed"})
    for ref in others:
        result.written.append(_give(dest_ref, ref, result, reporter, registry or RegistryOptions(), bool(opts.platforms), hook(ref)))
    return result


def check_destinations(refs: list, registry: RegistryOptions) -> list:
    """Refuse a destination named twice, and find every registry unreachable or refusing the push
    before any manifest is written: a repeated -t is all or nothing as far as a registry can tell."""
    seen = set()
    for ref in refs:
        if str(ref) in seen:
            raise DiskkitError(f"-t {ref}", "named twice")
        seen.add(str(ref))
    if len(refs) > 1:
        repositories = {(r.name.registry, r.name.repository): r for r in refs if r.transport == "docker"}
        for ref in repositories.values():  # local destinations are only opened to be written
            open_destination(ref, 0, registry).check_writable()
    return refs


def _give(first, ref, built: BuildResult, reporter: Reporter, registry: RegistryOptions, index: bool, before_manifest=None) -> dict:
    """The image already written to `first`, given to `ref`: a second tag in the same repository is
    one manifest PUT; elsewhere the image is copied from `first` (blobs a registry holds are mounted)."""
    if ref.transport == first.transport == "docker" and (ref.name.registry, ref.name.repository) == (first.name.registry, first.name.repository):
        from diskkit.transports import open_source

        with open_source(first, registry) as source:
            data, media, _ = source.top_manifest()
        with open_destination(ref, 0, registry) as dest:
            dest.before_manifest = before_manifest
            desc = dest.put_manifest(data, media or built.media_type)
        status = "tagged"
    else:
        from diskkit.ops.copy import copy_image

        desc = copy_image(first, ref, registry, reporter, multi_arch="all" if index else "system", before_manifest=before_manifest)
        status = "copied"
    reporter.note(f"{ref}: {status} {desc.digest}")
    return {"reference": str(ref), "digest": desc.digest, "status": status}


def _build(opts: BuildOptions, dest_ref, reporter: Reporter, registry: RegistryOptions | None, before_manifest=None) -> BuildResult:
    if opts.disk_format not in DISK_FORMATS:
        raise DiskkitError("--format", f"must be one of {', '.join(DISK_FORMATS)}")
    if opts.path is not None and (problem := path_problem(opts.path)):
        raise DiskkitError(f"--path {opts.path}", problem)
    if opts.path is not None and opts.path.endswith("/"):
        # KubeVirt would take "/disk/" for the file /disk; a build is told where to write the file.
        raise DiskkitError(f"--path {opts.path}", "names a directory; give the disk file's path, e.g. /disk/disk.qcow2")
    for artifact in (opts.kernel, opts.initrd):
        if artifact:
            check_input_file(artifact[1], "kernel-boot file")
    if opts.artifact:
        opts = _artifact_options(opts)
    auto_lazy = opts.lazy is None
    if auto_lazy:
        opts = replace(opts, lazy=opts.compression == "gzip")
    if opts.lazy and opts.compression not in ("gzip", "none"):
        raise DiskkitError("--lazy", f"writes a gzip or an uncompressed layer (read at offsets), not a {opts.compression} one")
    if opts.lazy_chunks is not None and (opts.lazy is False or opts.compression != "gzip"):
        raise DiskkitError("--lazy-chunks", "cuts a lazy gzip layer's disk; an uncompressed lazy layer (TOC v1) has fixed chunks, a plain one none")
    sources = opts.platforms or [(opts.platform, opts.source)]
    workdir = Path(tempfile.mkdtemp(prefix="diskkit-build-"))
    try:
        # Any bad input is refused before anything is written: what each file holds, then its disk.
        if opts.checksum is not None and len(sources) > 1:
            raise DiskkitError("--checksum", "names one input's digest; with several platforms give --checksum-file")
        skip, expected = _recorded_build(opts, dest_ref, sources, registry, before_manifest)
        if skip and (found := buildskip.held(skip[0], dest_ref, registry)) and (unchanged := _unchanged(found, opts, sources, dest_ref, reporter)):
            return unchanged
        disks = [input_disk(source, workdir / f"in{i}", reporter.note, opts.checksum, opts.checksum_file, registry, sums)
                 for i, ((_, source), sums) in enumerate(zip(sources, expected))]
        infos = [examine_input(disk, source) for disk, (_, source) in zip(disks, sources)]
        with open_destination(dest_ref, opts.created, registry) as dest:
            dest.before_manifest = before_manifest
            if opts.artifact and dest.docker_manifest:
                raise DiskkitError(str(dest_ref), "--artifact needs OCI manifests (artifactType, annotations); use oci:, oci-archive: or a registry")
            if opts.platforms and dest.docker_manifest:
                raise DiskkitError(str(dest_ref), "docker-archive holds a single image; build one platform at a time")
            holds_toc = not dest.docker_manifest and (dest.layer_compression or opts.compression) == opts.compression
            if auto_lazy and not holds_toc:
                opts = replace(opts, lazy=False)  # docker manifests carry no layer annotations: a plain layer there
            if opts.lazy and not holds_toc:
                raise DiskkitError(str(dest_ref), f"--lazy needs OCI manifests with annotations and a {opts.compression} layer; use oci:, oci-archive: or a registry")
            built = [
                _build_one(opts, dest, plat, source, disk, info, workdir / str(i), reporter, child=bool(opts.platforms))
                for i, ((plat, source), disk, info) in enumerate(zip(sources, disks, infos))
            ]
            if opts.platforms:
                index = make_index([b.descriptor for b in built], {"org.opencontainers.image.created": rfc3339(opts.created), **opts.metadata.index_annotations})
                desc = dest.put_manifest(canonical_json(index), OCI_INDEX)
        first = built[0]
        result = first if not opts.platforms else BuildResult(
            str(dest_ref), desc.digest, OCI_INDEX, desc.size, [l for b in built for l in b.layers],
            first.disk_path, first.disk_format, first.virtual_size, built,
        )
        if skip and skip[1] and (problem := buildskip.store(skip[0], result.to_json())):
            reporter.note(problem)
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _recorded_build(opts: BuildOptions, dest_ref, sources, registry, before_manifest) -> tuple[tuple[str, bool] | None, list]:
    """The build record's (name, writable) when this build may be answered from one, and each source's
    expected checksums (None: input_disk reads them). Only URLs are looked up this early (a checksum
    file is small); a manifest signed as it is stored is signed anew, so such a build is never skipped."""
    if not all(isinstance(src, str) and fetch.is_stream(src) and src != fetch.STDIN for _, src in sources):
        return None, [None] * len(sources)
    expected = [fetch.expectations(src, opts.checksum, opts.checksum_file, registry or RegistryOptions()) for _, src in sources]
    return (buildskip.key(opts, dest_ref, expected) if before_manifest is None else None), expected


def _unchanged(found: dict, opts: BuildOptions, sources, dest_ref, reporter: Reporter) -> BuildResult | None:
    """What an unchanged rebuild reports, from the record the destination's tag confirmed; None for
    a record that does not hold a whole result."""
    try:
        result = BuildResult.from_json(found, fetched=False)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    # The record is keyed by the destination as parsed: named as this build spells it, as a build would.
    for image in result.images:
        image.reference = opts.dest
    result.reference = str(dest_ref) if opts.platforms else opts.dest
    for _, src in sources:
        reporter.note(f"{fetch.shown(src)}: unchanged (same checksum and options); {dest_ref} still holds {result.digest}; not fetched")
    for layer in result.layers:
        reporter.event({"event": "blob", "digest": layer.digest, "size": layer.size, "status": "exists"})
    return result


def _artifact_options(opts: BuildOptions) -> BuildOptions:
    """An artifact holds the disk and nothing else: the flags that would add to it are refused."""
    given = [flag for flag, value in (("--platform OS/ARCH=FILE", opts.platforms), ("--kernel", opts.kernel), ("--initrd", opts.initrd),
                                      ("--path", opts.path), ("--label", any(opts.metadata.labels.values())), ("--env", any(opts.metadata.env.values())),
                                      ("--annotation index:", opts.metadata.index_annotations), ("--lazy", opts.lazy)) if value]
    if given:
        why = {"--path": "the disk is the layer's title, its file's name",
               "--label": "its config is empty ({}); use --annotation", "--env": "its config is empty ({})",
               "--lazy": "an uncompressed artifact is read at offsets as it is"}.get(given[0], "an artifact holds the disk alone")
        raise DiskkitError(f"--artifact {given[0]}", f"not with an artifact: {why}")
    return replace(opts, lazy=False)


def _build_one(opts, dest, plat: Platform, given: str | Path, disk: payload.Unwrapped, info, workdir: Path, reporter: Reporter, child: bool) -> BuildResult:
    workdir.mkdir(parents=True)
    # A download is pinned by the checksums its bytes were verified against (a URL's bytes may change
    # under it, and its temporary copy is new each time): without one, no record and no shortcut.
    streamed = fetch.is_stream(given)
    source = disk.path if streamed else Path(given)
    disk_format = _target_format(opts.disk_format, info.format)
    if opts.artifact:
        title = _disk_name(disk, disk_format != info.format, disk_format)
        compression = dest.layer_compression or opts.compression
        if note := artifactbuild.compressed_note(compression):
            reporter.note(note)
        made = artifactbuild.write(dest, title, disk_format, info.virtual_size,
                                   lambda: _prepare_format(opts, source, disk.path, info, workdir, reporter)[0],
                                   compression, opts.level, opts.created, opts.metadata.annotations_for(plat), reporter)
        return BuildResult(opts.dest, made.digest, OCI_MANIFEST, made.size, [made.layer], f"/{title}", disk_format, info.virtual_size,
                           descriptor=Descriptor(OCI_MANIFEST, made.digest, made.size))
    image_disk_path = opts.path or f"/disk/{_disk_name(disk, disk_format != info.format, disk_format)}"
    compression = dest.layer_compression or opts.compression
    docker = dest.docker_manifest
    layer_media = docker_layer(compression) if docker else oci_layer(compression)
    label = f"{plat} {image_disk_path}" if child else image_disk_path

    prepared: list[Path] = []

    def send() -> LayerResult:
        # Converted (when asked) only here, once: an unchanged rebuild the destination holds needs no disk.
        if not prepared:
            prepared.append(_prepare_format(opts, fetch.shown(given), disk.path, info, workdir, reporter)[0])
        files = [(image_disk_path, prepared[0]), *(a for a in (opts.kernel, opts.initrd) if a)]
        entries = entries_for(files)
        total = sum(e.size for e in entries)
        with dest.blob_writer(layer_media) as pending, reporter.task(label, total) as task:
            if opts.lazy and compression == "gzip":
                result = lazygzip.write_layer(entries, pending, opts.level, opts.created, task.advance, image_disk_path.lstrip("/"),
                                              content_defined=opts.lazy_chunks != "fixed")
            else:
                result = write_layer(entries, pending, compression, opts.level, opts.created, task.advance,
                                     toc_for=image_disk_path.lstrip("/") if opts.lazy else None)
            pending.commit(result.digest, result.size)
        return result

    recordable = not streamed or bool(disk.checked)
    record, settled = buildrecord.key(
        [*([] if streamed else [(image_disk_path, source)]), *((a[0], a[1]) for a in (opts.kernel, opts.initrd) if a)],
        {"diskFormat": disk_format, "inputFormat": info.format, "compression": compression, "level": opts.level,
         "lazy": bool(opts.lazy), "lazyChunks": opts.lazy_chunks or "content", "created": opts.created, "mediaType": layer_media},
        [(image_disk_path, fetch.shown(given), disk.checked)] if streamed else [],
    )
    settled = settled and recordable
    layer = buildrecord.lookup(record) if recordable else None
    place, recorded = _place(dest), buildrecord.places(record)
    status = _held(dest, place, Descriptor(layer_media, layer.digest, layer.size), recorded) if layer else None
    if status:
        # The same input gives the same bytes: the destination already holds what streaming would send.
        reporter.note(f"{label}: layer {layer.digest} {status} at the destination (unchanged input); not sent")
    else:
        layer = with_restarts(send, reporter, f"layer {image_disk_path}")
        status = "uploaded"
    if settled and (status != "exists" or recorded[:1] != [place]) and (problem := buildrecord.store(record, layer, place)):
        reporter.note(problem)
    reporter.event({"event": "blob", "digest": layer.digest, "size": layer.size, "status": status})
    layer_desc = Descriptor(layer_media, layer.digest, layer.size, layer.toc.annotations() if layer.toc else {})
    env = Metadata(env={"": [*opts.env, *opts.metadata.env_for(plat)]}).env_for(plat)
    config = make_config(plat, [layer.diff_id], opts.created, {**opts.labels, **opts.metadata.labels_for(plat)}, env, "diskkit build")
    config_desc = dest.put_blob(canonical_json(config), DOCKER_CONFIG if docker else OCI_CONFIG)
    annotations = {
        "org.opencontainers.image.created": rfc3339(opts.created),
        ANNOTATION_PATH: image_disk_path,
        ANNOTATION_FORMAT: disk_format,
        ANNOTATION_VIRTUAL_SIZE: str(info.virtual_size),
        **({lazytoc.ANNOTATION_LAZY: lazytoc.LAZY_VALUES[layer.toc_version]} if layer.toc else {}),
        **opts.annotations,
        **opts.metadata.annotations_for(plat),
    }
    manifest = make_manifest(config_desc, [layer_desc], annotations, docker)
    desc = dest.put_manifest(canonical_json(manifest), manifest["mediaType"], plat.to_json(), child=child)
    return BuildResult(
        opts.dest, desc.digest, manifest["mediaType"], desc.size, [layer], image_disk_path, disk_format, info.virtual_size,
        descriptor=Descriptor(manifest["mediaType"], desc.digest, desc.size, opts.metadata.descriptor_for(plat), platform=plat.to_json()),
    )


def _place(dest) -> str | None:
    """"HOST/REPO" for a registry destination (where a later build may mount the layer from), else None."""
    ref = getattr(dest, "ref", None)
    return f"{ref.name.registry}/{ref.name.repository}" if getattr(ref, "transport", None) == "docker" else None


def _held(dest, place: str | None, desc: Descriptor, recorded: list[str]) -> str | None:
    """"exists" when the destination answers a HEAD for the recorded blob, "mounted" when the registry
    links it from another repository it was pushed to; None when the layer must be sent."""
    if dest.has_blob(desc):
        return "exists"
    host = place.split("/", 1)[0] if place else None
    for other in recorded:
        other_host, _, repository = other.partition("/")
        if host is not None and other != place and other_host == host and dest.mount(desc, repository):
            return "mounted"
    return None


def _target_format(wanted: str, found: str) -> str:
    """The disk's format in the image: `keep` keeps what KubeVirt boots, and makes anything else qcow2."""
    if wanted == "keep":
        return found if found in diskrules.ACCEPTED_FORMATS else "qcow2"
    return wanted


def _prepare_format(opts: BuildOptions, shown: str, source: Path, info: qemuimg.DiskInfo, workdir: Path, reporter: Reporter):
    wanted = opts.disk_format
    if wanted == "keep":
        if info.format in diskrules.ACCEPTED_FORMATS:
            if info.format == "raw":
                reporter.note(
                    f"{shown}: raw disk packaged as is; --format qcow2 usually makes a much smaller image "
                    "(container layers cannot hold sparse files)"
                )
            return source, info.format
        wanted = "qcow2"
        reporter.note(f"{shown}: converting {info.format} to qcow2 (KubeVirt boots only raw and qcow2)")
    if wanted == info.format:
        return source, info.format
    out = workdir / f"disk.{'qcow2' if wanted == 'qcow2' else 'img'}"
    with reporter.task(f"converting to {wanted}", 100) as task:
        last = [0.0]

        def advance(percent: float) -> None:
            task.advance(percent - last[0])
            last[0] = percent

        qemuimg.convert(source, out, info.format, wanted, progress=advance)
    return out, wanted


def _disk_name(disk: payload.Unwrapped, converted: bool, disk_format: str) -> str:
    if not converted:
        return disk.name
    stem = disk.name.rsplit(".", 1)[0] if "." in disk.name else disk.name
    return f"{stem}.{'qcow2' if disk_format == 'qcow2' else 'img'}"
