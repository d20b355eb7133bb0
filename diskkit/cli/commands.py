"""The `diskkit` command line: convert, build, inspect and verify containerDisk images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from diskkit import __version__
from diskkit.cli.shell import platform as platform_of
from diskkit.cli.shell import EXIT_EPILOG, registry_options, run_main
from diskkit.cli.exportcmd import export_cmd
from diskkit.cli.indexcmds import index_group
from diskkit.cli.sourceflags import checksum_options, retry_options
from diskkit.cli.attestcmd import verify_attestation
from diskkit.cli.standalone import standalone_sign, standalone_verify
from diskkit.cli.tagcmds import TAG_COMMANDS
from diskkit.cli.trustflags import signature_options
from diskkit.errors import DiskkitError, Exit
from diskkit.oci.image import Platform
from diskkit.oci.reference import parse_ref
from diskkit.progress import reporter_for
from diskkit.registry.options import RegistryOptions
from diskkit.streams.compression import KINDS


def _given(name: str) -> bool:
    """Whether the user set option `name` rather than leaving its default."""
    return click.get_current_context().get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXIT_EPILOG)
@click.version_option(__version__, prog_name="diskkit")
def cli() -> None:
    """Package VM disks as OCI images that KubeVirt boots as containerDisks. No container engine needed.

    Image references use the containers-transports syntax: oci:DIR[:TAG], oci-archive:FILE[:TAG],
    docker-archive:FILE[:NAME:TAG], dir:DIR, docker-daemon:NAME:TAG (the engine DOCKER_HOST names:
    dockerd or podman's service), containers-storage:NAME[:TAG] (podman's store, via CONTAINER_HOST).
    """


@cli.command(
    epilog="""\b
Examples:
  diskkit convert fedora.vmdk fedora.qcow2
  diskkit convert -O qcow2 -c disk.raw disk.qcow2
  diskkit convert -O raw disk.qcow2 disk.img
  diskkit convert Fedora-Cloud.qcow2.xz fedora.qcow2            # xz, gzip, zstd, bzip2 and tar unwrapped first
  diskkit convert https://example.org/f40.qcow2.xz f40.qcow2 --checksum-file https://example.org/CHECKSUM
  curl -sL https://example.org/f40.raw.xz | diskkit convert - f40.qcow2
"""
)
@click.argument("src")
@click.argument("dest", type=click.Path(path_type=Path, readable=False))
@click.option("-O", "out_format", type=click.Choice(["qcow2", "raw"]), default="qcow2", show_default=True, help="Output format.")
@click.option("-c", "compress", is_flag=True, help="Compress qcow2 clusters (smaller, slower to read).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the destination's path.")
@checksum_options
@retry_options
def convert(src: str, dest: Path, out_format: str, compress: bool, checksum: str | None, checksum_file: str | None, registry: RegistryOptions,
            as_json: bool) -> None:
    """Convert a raw, qcow2, vmdk, vdi, vpc or vhdx disk to qcow2 or raw with qemu-img.

    A disk compressed with xz, gzip, zstd or bzip2, or alone in a tar archive, is unwrapped first.
    SRC may be an http(s) URL or - (stdin), read as `diskkit build` reads them.
    The input is checked first (qemu-img info and check, under CPU and memory limits); the output
    is written under a temporary name and renamed only when complete.
    """
    import shutil
    import tempfile

    from diskkit.disk import qemuimg
    from diskkit.ops.build import examine_input, input_disk
    from diskkit.source.fetch import is_stream
    from diskkit.streams import fsutil

    if not is_stream(src) and dest.resolve() == Path(src).resolve():
        raise DiskkitError(dest, "destination is the source; choose another file")
    reporter = reporter_for()
    workdir = Path(tempfile.mkdtemp(prefix="diskkit-convert-"))
    tmp = fsutil.staging_file(dest)
    try:
        disk = input_disk(src, workdir, reporter.note, checksum, checksum_file, registry)
        info = examine_input(disk, src)
        with reporter.task(f"converting {disk.name}", 100) as task:
            done = [0.0]

            def advance(percent: float) -> None:
                task.advance(percent - done[0])
                done[0] = percent

            qemuimg.convert(disk.path, tmp, info.format, out_format, compress, advance)
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    click.echo(json.dumps({"source": str(src), "destination": str(dest), "format": out_format, "inputFormat": info.format}, indent=2) if as_json else str(dest))


@cli.command(
    epilog="""\b
Examples:
  diskkit build fedora.qcow2 -t oci:./layout:fedora-40
  diskkit build Fedora-Cloud.qcow2.xz -t oci:./layout:fedora-40     # decompressed first: /disk/Fedora-Cloud.qcow2
  diskkit build fedora.qcow2 -t quay.io/me/fedora:40                 # streams straight to the registry
  diskkit build fedora.qcow2 -t quay.io/me/fedora:40-2611251200 -t quay.io/me/fedora:40 -t quay.io/me/fedora:latest
  diskkit build disk.img --format qcow2 -t oci-archive:fedora.tar
  diskkit build disk.qcow2 -t docker-archive:fedora.tar:quay.io/me/fedora:40   # then: podman load -i fedora.tar
  diskkit build disk.qcow2 -t docker-daemon:quay.io/me/fedora:40     # into dockerd (or podman: DOCKER_HOST)
  diskkit build disk.qcow2 --path /images/root.qcow2 -t oci:./layout
  diskkit build disk.qcow2 -t quay.io/me/fedora:40                   # lazy (seekable gzip) by default
  diskkit build disk.qcow2 --no-lazy -t quay.io/me/fedora:40         # one plain gzip stream
  diskkit build disk.qcow2 --kernel ./vmlinuz --initrd /boot/initrd.img=./initrd -t oci:./layout:kb
  diskkit build --platform linux/amd64=x86.qcow2 --platform linux/arm64=arm.qcow2 -t quay.io/me/fedora:40
  diskkit build --platform linux/amd64=x86.qcow2 --platform linux/arm64=arm.qcow2 -t quay.io/me/fedora:40 \\
      --default-instancetype u1.medium --default-preference linux/amd64:fedora --default-preference linux/arm64:fedora.arm64 \\
      --annotation index,manifest:org.opencontainers.image.version=40
  diskkit build https://example.org/f40.qcow2.xz --checksum-file https://example.org/CHECKSUM -t quay.io/me/fedora:40
  diskkit build https://example.org/f40.qcow2 --checksum sha256:9f86d0...0f00a08 -t quay.io/me/fedora:40
  curl -sL https://example.org/f40.qcow2.xz | diskkit build - --checksum sha256:... -t oci:./layout:40   # /disk/disk.qcow2
  SOURCE_DATE_EPOCH=1700000000 diskkit build disk.qcow2 -t oci:./layout --json
  diskkit build disk.qcow2 -t quay.io/me/fedora:40 --label shasum=$SUM --skip-if-label shasum=$SUM   # exit 0, nothing done when unchanged
  diskkit build disk.qcow2 -t quay.io/me/fedora:40 --sign-by-sigstore-private-key ci.private --sign-passphrase-file pass
  diskkit build disk.qcow2 -t quay.io/me/fedora:40 --sign-by 3F1A...C0DE      # GPG, into the registries.d lookaside
  diskkit build --artifact disk.img -t quay.io/me/fedora:40-artifact   # OCI artifact: the disk as one file layer, as ORAS pushes it
"""
)
@click.argument("src", required=False)
@click.option("-t", "--tag", "dests", required=True, multiple=True, metavar="DEST", help="Where to write: docker://HOST/REPO:TAG (or bare HOST/REPO:TAG), oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE[:REF], docker-daemon:NAME:TAG. Repeat for more tags: blobs go up once, every registry is checked before the first push, each destination is reported.")
@click.option("--path", "image_path", metavar="/DIR/NAME", help="Put the disk here instead of /disk/<name> (containerDisk.path).")
@click.option("--format", "disk_format", type=click.Choice(["keep", "qcow2", "raw"]), default="keep", show_default=True, help="Disk format inside the image.")
@click.option("--compression", type=click.Choice(list(KINDS)), default="gzip", show_default=True, help="Layer compression.")
@click.option("--level", type=int, help="Compression level (gzip 0-3, default 1; zstd 1-19, default 3).")
@click.option("--lazy/--no-lazy", default=None, help="Seekable layer with a chunk table of contents, so `launcher run` boots it before it has arrived (gzip: one gzip member per chunk, read by every client as any gzip layer; with --compression none the v1 uncompressed layout). Default: on for gzip layers in OCI manifests.")
@click.option("--lazy-chunks", "lazy_chunks", type=click.Choice(["content", "fixed"]), help="How a lazy gzip layer's disk is cut into chunks: content (the default, TOC v3): where its bytes say, so a chunk keeps its identity when a rebuild moves it and an update costs its change; fixed: 1 MiB chunks (TOC v2), for nodes whose launcher predates TOC v3.")
@click.option("--kernel", metavar="[/PATH=]FILE", help="Add a kernel for kernelBoot (default path /boot/vmlinuz).")
@click.option("--initrd", metavar="[/PATH=]FILE", help="Add an initrd for kernelBoot (default path /boot/initrd.img).")
@click.option("--platform", "platforms", multiple=True, metavar="OS/ARCH[=FILE]", help="Guest platform (default linux/amd64); repeat as OS/ARCH=FILE for a multi-platform index.")
@click.option("--label", multiple=True, metavar="[OS/ARCH:]KEY=VALUE", help="Config label (repeatable); with OS/ARCH: only that platform's image.")
@click.option("--annotation", multiple=True, metavar="[TYPE[,TYPE][[OS/ARCH]]:]KEY=VALUE", help="Annotation, as docker buildx: TYPE manifest (default), index, or manifest-descriptor (the index's entry), e.g. index:org.opencontainers.image.source=URL or manifest[linux/arm64]:KEY=VALUE.")
@click.option("--env", multiple=True, metavar="[OS/ARCH:]KEY=VALUE", help="Config environment variable (repeatable); with OS/ARCH: only that platform's image.")
@click.option("--default-instancetype", "default_instancetype", multiple=True, metavar="[OS/ARCH:]NAME[:KIND]", help="The instance type a VM inferring from this image gets: the instancetype.kubevirt.io/default-instancetype(-kind) labels and the INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE(_KIND) ENV CDI reads.")
@click.option("--default-preference", "default_preference", multiple=True, metavar="[OS/ARCH:]NAME[:KIND]", help="The preference likewise (instancetype.kubevirt.io/default-preference(-kind), INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE(_KIND)).")
@checksum_options
@click.option("--skip-if-label", "skip_if_label", multiple=True, metavar="[OS/ARCH:]KEY=VALUE", help="Do nothing (exit 0) when the first destination's image already carries this label, for every platform built or, with OS/ARCH:, for that one (repeatable: all must match); a missing tag, repository or platform builds.")
@click.option("--artifact", is_flag=True, help="Write an OCI 1.1 artifact, as `oras push` of the disk file: artifactType, an empty config, the disk as one blob (no tar) titled with its file name, and kubevirt.io/image-volume-skip-digest-resolution; KubeVirt boots it through an image volume. Uncompressed unless --compression says otherwise (CRI-O mounts the blob as it is).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the digest; progress as JSON lines on stderr.")
@registry_options
@signature_options(policy=False)
def build_cmd(src, dests, image_path, disk_format, compression, level, lazy, lazy_chunks, kernel, initrd, platforms, label, annotation, env, default_instancetype,
              default_preference, checksum, checksum_file, skip_if_label, artifact, as_json, registry: RegistryOptions, sign) -> None:
    """Package disk SRC as a scratch-based containerDisk image.

    One layer holds /disk/ (0555) and /disk/<name> (0440), both owned by qemu (107:107), as KubeVirt
    expects. The disk is read once: tar framing, compression, both digests and the upload happen in
    one pass. The same input and flags always give the same digest (timestamps from
    SOURCE_DATE_EPOCH, else 1970). Prints the manifest digest last. SRC may be compressed (xz,
    gzip, zstd, bzip2) or a tar holding one disk: it is unwrapped into a sparse temporary file first.

    SRC may be an http(s) URL or - (stdin): it is hashed, unwrapped and written to that one
    temporary file as it arrives; a dropped connection resumes where it stopped (Range, with
    If-Range so a file changed meanwhile is read again from its start). With --checksum or
    --checksum-file the bytes received must match before anything is written to a destination.
    A URL build pinned so is remembered (under ~/.cache/diskkit/builds): rebuilt with the same
    checksum and flags while its tag (registry or oci:) still names the image it wrote, it fetches
    nothing and pushes nothing ("sourceFetched": false in --json). Without a checksum nothing pins
    a URL's bytes: it is downloaded every time.
    """
    from diskkit.ops.build import BuildOptions, build, source_epoch, split_artifact
    from diskkit.ops.buildmeta import parse as parse_metadata

    per_platform = [p for p in platforms if "=" in p]
    if per_platform and (len(per_platform) != len(platforms) or src is not None):
        raise DiskkitError("--platform", "give either SRC with one --platform OS/ARCH, or only --platform OS/ARCH=FILE options")
    if not per_platform and src is None:
        raise DiskkitError("SRC", "missing: give a disk file, an http(s) URL or - for stdin (or --platform OS/ARCH=FILE for each platform)")
    if len(platforms) > 1 and not per_platform:
        raise DiskkitError("--platform", "several platforms need a file each: --platform OS/ARCH=FILE")
    dest = dests[0]
    opts = BuildOptions(
        source=src,
        dest=dest,
        also=list(dests[1:]),
        path=image_path,
        kernel=split_artifact(kernel, "/boot/vmlinuz", "--kernel") if kernel else None,
        initrd=split_artifact(initrd, "/boot/initrd.img", "--initrd") if initrd else None,
        compression="none" if artifact and not _given("compression") else compression,
        level=level,
        lazy=lazy,
        lazy_chunks=lazy_chunks,
        disk_format=disk_format,
        platform=Platform.parse(platforms[0]) if platforms and not per_platform else Platform("linux", "amd64"),
        created=source_epoch(),
        platforms=[(Platform.parse(p.split("=", 1)[0]), p.split("=", 1)[1]) for p in per_platform],
        artifact=artifact,
        checksum=checksum,
        checksum_file=checksum_file,
    )
    opts.metadata = parse_metadata([p for p, _ in opts.platforms] or [opts.platform], bool(opts.platforms), label, env, annotation,
                                   default_instancetype, default_preference)
    if skip_if_label and _nothing_to_do(opts, skip_if_label, registry, as_json):
        return
    signers = [_signer(d, sign, registry) for d in dests]
    hooks = {str(parse_ref(d)): _before_manifest(s) for d, s in zip(dests, signers)}
    reporter = reporter_for(as_json)
    result = build(opts, reporter, registry, lambda ref: hooks.get(str(ref)))
    signed: dict = {}
    for d, signer, written in zip(dests, signers, result.written or [{"digest": result.digest}]):
        # One signature per destination, each naming its own reference, as a skopeo copy to each would.
        for digest in _sign(d, written["digest"], signer, registry).get("signed", []):
            signed.setdefault("signed", []).append(digest)
        _say_where_signed(_before_manifest(signer), reporter)
    if as_json:
        click.echo(json.dumps({**result.to_json(), **signed}, indent=2))
    else:
        click.echo(result.digest)


cli.add_command(build_cmd, "build")


def _nothing_to_do(opts, pairs, registry: RegistryOptions, as_json: bool) -> bool:
    from diskkit.ops.labelcheck import already_there, parse_pairs

    platforms = [p for p, _ in opts.platforms] or [opts.platform]
    why = already_there(opts.dest, platforms, parse_pairs(pairs, platforms), registry)
    if why is not None:
        click.echo(json.dumps({"reference": opts.dest, "skipped": True, "reason": why}, indent=2) if as_json else why)
    return why is not None


def _signer(dest: str, sign, registry: RegistryOptions | None = None):
    """(destination, decrypted key) for sigstore, a SimpleSigner for GPG; checked before anything is
    pushed; else None."""
    if sign is None:
        return None
    if sign.sign_by:
        from diskkit.signing.simple import SimpleSigner

        return SimpleSigner(parse_ref(dest), sign, registry)
    from diskkit.signing.trust import check_signable, load_signer

    return check_signable(dest, sign), load_signer(sign)


def _before_manifest(signer):
    """GPG signatures are made before each manifest is stored; sigstore ones after the push."""
    return signer if signer is not None and not isinstance(signer, tuple) else None


def _signature_copier(src: str, dest: str, src_opts: RegistryOptions, trust, signer, dest_opts: RegistryOptions | None = None):
    """(before_manifest, whether the source's manifest has GPG signatures to carry over)."""
    from diskkit.oci.image import sha256_digest
    from diskkit.signing.simple import SignatureCopier
    from diskkit.transports import open_source

    copier = SignatureCopier(parse_ref(src), parse_ref(dest), trust.registries_d, signer, src_opts, dest_opts)
    with open_source(src, src_opts) as source:
        data, _, desc = source.manifest_descriptors()
    carried = copier.of_source(desc.digest if desc else sha256_digest(data), True)
    copier.check_destination(carried)
    return copier, bool(carried)


def _say_where_signed(hook, reporter) -> None:
    """GPG signatures left in the built-in lookaside, which nodes are not told of: said in one line."""
    note = hook.default_place_note() if hook is not None else None
    if note:
        reporter.note(note)


def _sign(dest: str, digest: str, signer, registry: RegistryOptions, instances: bool = True) -> dict:
    if signer is None:
        return {}
    if not isinstance(signer, tuple):
        return {"signed": signer.signed}
    from diskkit.signing.trust import sign_pushed

    return {"signed": sign_pushed(signer[0], digest, signer[1], registry, instances)}


@cli.command("generate-sigstore-key", epilog="""\b
Examples:
  diskkit generate-sigstore-key --output-prefix ci            # asks for a passphrase; writes ci.private, ci.pub
  diskkit generate-sigstore-key --output-prefix ci --passphrase-file pass
""")
@click.option("--output-prefix", required=True, metavar="PREFIX", help="Write PREFIX.private and PREFIX.pub.")
@click.option("--passphrase-file", type=click.Path(dir_okay=False, path_type=Path), help="Read the passphrase from this file (else it is asked on the terminal).")
@click.option("--json", "as_json", is_flag=True, help='Print {"privateKey": ..., "publicKey": ...}.')
def generate_key_cmd(output_prefix: str, passphrase_file: Path | None, as_json: bool) -> None:
    """Generate a sigstore key pair for --sign-by-sigstore-private-key, as `skopeo generate-sigstore-key`.

    PREFIX.private is the passphrase-encrypted ECDSA P-256 key (cosign's format); PREFIX.pub is the
    public key that policy.json's sigstoreSigned keyPath names. Existing files are not overwritten.
    """
    from diskkit.signing.keys import read_passphrase, write_key_files

    private_path, public_path = Path(output_prefix + ".private"), Path(output_prefix + ".pub")
    for path in (private_path, public_path):
        if path.exists():
            raise DiskkitError(path, "refusing to overwrite an existing file")
    write_key_files(private_path, public_path, read_passphrase(passphrase_file, "Passphrase for the new key: ", confirm=True))
    click.echo(json.dumps({"privateKey": str(private_path), "publicKey": str(public_path)}, indent=2) if as_json else f"Key written to {private_path} and {public_path}")


@cli.command("inspect", epilog="""\b
Examples:
  diskkit inspect oci:./layout:fedora-40
  diskkit inspect --json docker-archive:fedora.tar
  diskkit inspect docker://quay.io/containerdisks/fedora:40
  diskkit inspect --raw docker://quay.io/containerdisks/fedora:40 | jq .
  diskkit inspect --config --raw oci:./layout:fedora-40
""")
@click.argument("ref")
@click.option("--platform", help="OS/ARCH to pick from a multi-platform index (default: this host's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--path", "image_path", metavar="/DIR/NAME", help="Where the disk is in the image (default: the image's io.diskkit.disk.path annotation, else the one file in /disk).")
@click.option("--raw", is_flag=True, help="Print the manifest (or index) bytes as stored, as skopeo inspect --raw.")
@click.option("--config", "show_config", is_flag=True, help="Print the image's config (with --raw: its bytes as stored).")
@registry_options
@signature_options(sign=False)
def inspect_cmd(ref: str, platform: str | None, as_json: bool, image_path: str | None, raw: bool, show_config: bool,
                registry: RegistryOptions, trust) -> None:
    """Show an image's manifest, config, layers and disk (path, format, virtual size, owner, mode).

    Registry images are described without pulling their layers. The signature policy is enforced
    first. Exits 1 when it lists a problem.
    """
    from diskkit.ops.verify import describe, inspect
    from diskkit.signing.trust import enforce_ref

    enforce_ref(ref, trust, registry, platform_of(platform))
    if raw or show_config:
        from diskkit.transports import open_source

        with open_source(ref, registry) as source:
            if show_config:
                data = source.image(platform_of(platform)).config_bytes
                out = data if raw else (json.dumps(json.loads(data), indent=4) + "\n").encode()
            else:
                out = source.top_manifest()[0]
        sys.stdout.buffer.write(out)
        return
    report = inspect(ref, platform_of(platform), registry, image_path)
    data = describe(report)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        sys.exit(1 if data["problems"] else 0)
    disk = data["disk"]
    lines = [
        f"Reference:    {data['reference']}",
        f"Digest:       {data['digest']}",
        f"MediaType:    {data['mediaType']}",
        *([f"ArtifactType: {data['artifactType']}"] if data.get("artifactType") else []),
        f"Platform:     {data['os']}/{data['architecture']}",
    ]
    if data["created"]:
        lines.append(f"Created:      {data['created']}")
    for key, value in sorted(data["labels"].items()):
        lines.append(f"Label:        {key}={value}")
    for key, value in sorted(data["annotations"].items()):
        lines.append(f"Annotation:   {key}={value}")
    for layer in data["layers"]:
        lines.append(f"Layer:        {layer['digest']} {layer['size']} bytes {layer['mediaType']}")
    if disk["path"]:
        lines.append(f"Disk:         {disk['path']}")
    elif parse_ref(ref).transport == "docker":
        lines.append("Disk:         not described (no io.diskkit.disk.* annotations; `diskkit verify` reads the layers)")
    else:
        lines.append("Disk:         none found (not a containerDisk: no single file in /disk; see --path)")
    if disk["format"]:
        size = disk["virtualSize"]
        lines.append(f"  format:     {disk['format']}, virtual size {size} bytes ({size / (1 << 30):.2f} GiB)" if size else f"  format:     {disk['format']}")
    if disk["uid"] is not None:
        lines.append(f"  owner:      {disk['uid']}:{disk['gid']}, mode {disk['mode']}, {disk['size']} bytes in the layer")
    for problem in data["problems"]:
        lines.append(f"Problem:      {problem}")
    click.echo("\n".join(lines))
    sys.exit(1 if data["problems"] else 0)


@cli.command("verify", epilog="""\b
Examples:
  diskkit verify oci:./layout:fedora-40
  diskkit verify --path /images/root.qcow2 oci-archive:custom.tar
  diskkit verify --tls-verify=false localhost:5000/disks/fedora:40
  diskkit verify --key ci.pub --key old.pub quay.io/me/fedora:40
  diskkit verify --all-platforms quay.io/me/fedora:40                 # every image of the index
""")
@click.argument("ref")
@click.option("--path", "image_path", metavar="/DIR/NAME", help="The containerDisk.path the VMI will use (default: the one file in /disk).")
@click.option("--platform", help="OS/ARCH to pick from a multi-platform index (default: this host's).")
@click.option("--all-platforms", "all_platforms", is_flag=True, help="Verify every platform an index lists (and that each entry's config is for the platform the index says); exit 8 if any fails.")
@click.option("--key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE", help="Also report whether the image is signed by this sigstore public key (repeatable); none of them: exit 8.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@registry_options
def verify_cmd(ref: str, image_path: str | None, platform: str | None, all_platforms: bool, keys: tuple[Path, ...], as_json: bool, registry: RegistryOptions) -> None:
    """Check an image (ours or anyone's) the way KubeVirt consumes it; exit 8 listing every violation.

    Checks every blob digest and diffID, finds the disk as KubeVirt does (exactly one entry in
    /disk, or --path resolved inside the image), that UID 107 can read it, and that it is raw or
    qcow2 with no backing file, no external data file and no corruption.
    """
    from diskkit.ops.verify import describe, verify

    if all_platforms:
        if platform:
            raise DiskkitError("--all-platforms", "give either --platform or --all-platforms")
        _verify_all(ref, image_path, keys, as_json, registry)
        return
    report = verify(ref, image_path, platform_of(platform), registry)
    signature = _signature_report(ref, keys, registry, report.problems) if keys else {}
    for note in report.notes if not as_json else ():
        click.echo(f"note: {ref}: {note}", err=True)
    if as_json:
        click.echo(json.dumps({**describe(report), **signature, "ok": report.ok}, indent=2))
    elif report.ok:
        disk = report.disk
        click.echo(f"OK {ref}: {disk.path} is {disk.format}, virtual size {disk.virtual_size} bytes, readable by UID 107")
        for signer in signature.get("signedBy", []):
            click.echo(f"OK {ref}: {signer['digest']} signed by {signer['key']} as {signer['identity']}")
    else:
        for problem in report.problems:
            click.echo(f"{ref}: {problem}", err=True)
    sys.exit(report.exit_code)


def _verify_all(ref: str, image_path: str | None, keys: tuple[Path, ...], as_json: bool, registry: RegistryOptions) -> None:
    from diskkit.ops.verify import describe, verify_all

    results = verify_all(ref, image_path, registry)
    problems: list[str] = []
    signature = _signature_report(ref, keys, registry, problems) if keys else {}
    ok = not problems and all(report.ok for _, report in results)
    # The first failing platform's own status (not found, auth, unreachable keep theirs); else a verification failure.
    status = next((report.exit_code for _, report in results if not report.ok), Exit.VERIFY_FAILED if problems else Exit.OK)
    if as_json:
        platforms = [{"platform": str(plat) if plat else None, **describe(report), "ok": report.ok} for plat, report in results]
        click.echo(json.dumps({"reference": ref, "platforms": platforms, **signature, "problems": problems, "ok": ok}, indent=2))
        sys.exit(status)
    for plat, report in results:
        shown = f"{ref} [{plat}]" if plat else ref
        if report.ok:
            disk = report.disk
            click.echo(f"OK {shown}: {disk.path} is {disk.format}, virtual size {disk.virtual_size} bytes, readable by UID 107")
        for problem in report.problems:
            click.echo(f"{shown}: {problem}", err=True)
    for problem in problems:
        click.echo(f"{ref}: {problem}", err=True)
    sys.exit(status)


def _signature_report(ref: str, keys: tuple[Path, ...], registry: RegistryOptions, problems: list[str]) -> dict:
    from diskkit.signing.trust import signers

    digest, count, found = signers(ref, list(keys), registry)
    if not found:
        given = ", ".join(str(k) for k in keys)
        problems.append(f"{digest}: not signed by {given} ({count} signature{'s' if count != 1 else ''} found)")
    return {"signatures": count, "signedBy": [{"key": s.key, "identity": s.identity, "digest": s.digest} for s in found]}


@cli.command("push", epilog="""\b
Examples:
  diskkit push oci:./layout:fedora-40 quay.io/me/fedora:40
  diskkit push docker://quay.io/me/fedora:40 oci-archive:fedora.tar
  diskkit push --all docker://quay.io/me/fedora:40 docker://registry.local/me/fedora:40
  diskkit push --tls-verify=false docker-archive:fedora.tar localhost:5000/fedora:40
  diskkit copy --src-creds me:pw --dest-tls-verify=false docker://quay.io/me/f:40 docker://localhost:5000/f:40
  diskkit copy --preserve-digests --multi-arch all docker://quay.io/me/f:40 dir:./f40
  diskkit copy --multi-arch index-only docker://quay.io/me/f:40 docker://registry.local/me/f:40   # its images are there already
  DOCKER_HOST=unix:///run/podman/podman.sock diskkit push docker-daemon:quay.io/me/fedora:40 oci:./layout:f40
  diskkit push --sign-by-sigstore-private-key ci.private --sign-passphrase-file pass oci:./layout:40 quay.io/me/fedora:40
  diskkit push --signature-policy policy.json quay.io/me/fedora:40 oci:./mirror:40
  diskkit copy --sign-by 3F1A...C0DE --sign-passphrase-file pass docker://quay.io/me/f:40 docker://registry.local/me/f:40
  diskkit copy --remove-signatures docker://quay.io/me/f:40 oci:./mirror:40   # a layout keeps no GPG signatures
""")
@click.argument("src")
@click.argument("dest")
@click.option("--platform", help="OS/ARCH to pick from a multi-platform index (default: this host's).")
@click.option("--all", "all_platforms", is_flag=True, help="Copy every platform of an index, and the index itself.")
@click.option("--multi-arch", type=click.Choice(["system", "all", "index-only"]), help="As skopeo: system = this host's image (default), all = as --all, index-only = the index without its images.")
@click.option("--preserve-digests", is_flag=True, help="Fail instead of rewriting a manifest (format conversion, decompression).")
@click.option("--dest-compress", is_flag=True, help="Compress layers for destinations that keep them as they are (dir:), as skopeo does.")
@click.option("--dest-compress-format", type=click.Choice(["gzip", "zstd"]), help="Re-encode layers not already in this compression (registries, OCI layouts; dir: with --dest-compress).")
@click.option("--dest-compress-level", type=int, help="Its level (gzip 0-3, zstd 1-19; as diskkit build --level).")
@click.option("--format", "manifest_format", type=click.Choice(["oci", "v2s2"]), help="Restate manifests as OCI or Docker schema2, as skopeo copy --format.")
@click.option("--remove-signatures", is_flag=True, help="Do not copy the source's GPG signatures (lookaside, dir: signature-N), as skopeo.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object; events as JSON lines on stderr.")
@click.option("--src-tls-verify", type=click.BOOL, metavar="BOOL", help="--tls-verify for the source registry only.")
@click.option("--dest-tls-verify", type=click.BOOL, metavar="BOOL", help="--tls-verify for the destination registry only.")
@click.option("--src-creds", metavar="USER:PASS", help="--creds for the source registry only.")
@click.option("--dest-creds", metavar="USER:PASS", help="--creds for the destination registry only.")
@click.option("--src-authfile", type=click.Path(dir_okay=False), help="--authfile for the source registry only.")
@click.option("--dest-authfile", type=click.Path(dir_okay=False), help="--authfile for the destination registry only.")
@click.option("--src-cert-dir", type=click.Path(file_okay=False), help="--cert-dir for the source registry only.")
@click.option("--dest-cert-dir", type=click.Path(file_okay=False), help="--cert-dir for the destination registry only.")
@registry_options
@signature_options()
def push_cmd(src, dest, platform, all_platforms, multi_arch, preserve_digests, dest_compress, dest_compress_format, dest_compress_level,
             manifest_format, remove_signatures, as_json, registry: RegistryOptions, trust, sign, **sides) -> None:
    """Copy an image from any transport to any transport, as `skopeo copy` does (`copy` is the same command).

    Blobs the destination already has are skipped, blobs in another repository of the same
    registry are mounted, the rest stream through with their digests verified. Manifests keep
    their bytes and media type, so the digest printed is the source's. The --src-*/--dest-*
    flags apply to one side only and win over the plain ones, as in skopeo. The source must pass
    the signature policy before any blob moves; with a key, what was pushed is signed.
    """
    from dataclasses import replace

    from diskkit.ops.copy import copy_image
    from diskkit.signing.trust import enforce_ref

    if dest_compress_level is not None and dest_compress_format is None:
        raise DiskkitError("--dest-compress-level", "needs --dest-compress-format")
    if all_platforms and multi_arch is not None:  # skopeo cmd/skopeo/copy.go, in its words
        raise DiskkitError("--all", "Cannot use --all and --multi-arch flags together")
    multi_arch = "all" if all_platforms else multi_arch or "system"
    fields = {"tls_verify": "tls_verify", "creds": "creds", "authfile": "authfile", "cert_dir": "cert_dir"}
    src_opts = replace(registry, **{f: sides[f"src_{k}"] for k, f in fields.items() if sides[f"src_{k}"] is not None})
    dest_opts = replace(registry, **{f: sides[f"dest_{k}"] for k, f in fields.items() if sides[f"dest_{k}"] is not None})
    enforce_ref(src, trust, src_opts, platform_of(platform), {"system": "selected", "all": "every", "index-only": "none"}[multi_arch])
    signer = _signer(dest, sign, dest_opts)
    hook = _before_manifest(signer)
    if not remove_signatures and parse_ref(src).transport in ("docker", "dir"):
        hook, carried = _signature_copier(src, dest, src_opts, trust, hook, dest_opts)
        # containers/image copy: signatures are kept only on the very bytes they sign.
        if carried and not preserve_digests:
            preserve_digests = "Would invalidate signatures (copy with --remove-signatures)"
    reporter = reporter_for(as_json)
    result = copy_image(src, dest, src_opts, reporter, platform_of(platform), multi_arch, dest_opts, preserve_digests,
                        manifest_format, dest_compress_format or ("gzip" if dest_compress else None), dest_compress_level, dest_compress,
                        hook)
    signed = _sign(dest, result.digest, signer, dest_opts, instances=multi_arch != "index-only")
    _say_where_signed(hook, reporter)
    click.echo(json.dumps({**result.to_json(), **signed}, indent=2) if as_json else result.digest)


cli.add_command(push_cmd, "copy")


@cli.command("upload", epilog="""\b
Examples:
  diskkit upload fedora fedora.qcow2 --url https://node:8443 --token "$(launcher dv token fedora)"
  DISKKIT_UPLOAD_URL=http://127.0.0.1:8443 DISKKIT_UPLOAD_TOKEN=... diskkit upload vms/root root.img --json
""")
@click.argument("datavolume", metavar="[NAMESPACE/]DATAVOLUME")
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--url", envvar="DISKKIT_UPLOAD_URL", required=True, help="The upload endpoint (launcher serve --upload-listen); env DISKKIT_UPLOAD_URL.")
@click.option("--token", envvar="DISKKIT_UPLOAD_TOKEN", help="Upload token (launcher dv token); env DISKKIT_UPLOAD_TOKEN.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path), help="Read the token from this file.")
@click.option("-n", "--namespace", default="default", show_default=True, help="Namespace of the DataVolume (or give NAMESPACE/NAME).")
@click.option("--ca-cert", type=click.Path(dir_okay=False, exists=True), help="CA bundle to verify an HTTPS endpoint with.")
@click.option("--insecure", is_flag=True, help="Do not verify the endpoint's TLS certificate.")
@click.option("--retry-times", type=click.IntRange(0, 100), default=5, show_default=True, help="Reconnections after a dropped connection (each resumes where the server stopped).")
@click.option("--wait", type=click.FloatRange(0), default=60, show_default=True, metavar="SECONDS", help="How long to wait for the DataVolume to become UploadReady.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object; events as JSON lines on stderr.")
def upload_cmd(datavolume, file, url, token, token_file, namespace, ca_cert, insecure, retry_times, wait, as_json) -> None:
    """Upload FILE (raw, qcow2, vmdk, vdi, vpc or vhdx) into an upload DataVolume's claim.

    A dropped connection does not start the upload over (virtctl image-upload does): the client
    asks the server how much it holds and sends the rest. The server checks the file's sha256,
    validates the image and converts it to raw as an import does. A DataVolume whose storage class
    waits for its first consumer fails at once: cannot upload to DataVolume in state
    WaitForFirstConsumer.
    """
    from diskkit.ops.upload import UploadOptions, upload

    if token_file is not None:
        token = token_file.read_text().strip()
    if not token:
        raise DiskkitError("--token", "required (or --token-file, or $DISKKIT_UPLOAD_TOKEN)")
    namespace, _, name = datavolume.rpartition("/") if "/" in datavolume else (namespace, "", datavolume)
    opts = UploadOptions(url, token, False if insecure else (ca_cert or True), retry_times, wait)
    result = upload(opts, namespace, name, file, reporter_for(as_json))
    click.echo(json.dumps(result, indent=2) if as_json else f"{namespace}/{name}: {result['phase']}")


cli.add_command(standalone_sign)
cli.add_command(standalone_verify)
cli.add_command(verify_attestation)
for command in TAG_COMMANDS:
    cli.add_command(command)
cli.add_command(index_group)
cli.add_command(export_cmd)


def main() -> None:
    run_main(cli, "diskkit")
