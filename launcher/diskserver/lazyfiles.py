"""kernelBoot artifacts (firmware.kernelBoot.container) out of a lazy image, its disk layer never fetched whole.

A kernel and an initrd are small files a VM needs whole before it starts, so they are not served:
they are taken out of the layers as imagewalk reads them, each checked before it is used (a small
layer read whole against its digest and diffID; a file in the lazy layer, in the members around the
disk's, against its digest in the TOC's `files`), and installed in the node cache as `launcher pull`
installs them (the same ref record, so later pulls and runs find them). A file nothing but the whole
blob's digest would vouch for (a TOC written before `files`) is pulled whole, with a note.
"""

from __future__ import annotations

from diskkit.disk.containerdisk import locate
from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci.image import Platform
from diskkit.oci.reference import parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.signing.trust import TrustOptions, enforce_source
from diskkit.streams.fsutil import write_atomic
from diskkit.transports import open_source
from launcher.diskserver import imagewalk
from launcher.diskserver.client import qualified
from launcher.diskserver.lazydisk import BlobRanges
from launcher.node.cache import Cache
from launcher.node.pull import Pulled, cached, image_key, remember


def fetch_files(cache: Cache, ref: str, paths: list[str], platform: Platform | None, registry: RegistryOptions | None,
                policy: str, notes: list[str]) -> dict[str, Pulled] | None:
    """The files at `paths` in `ref` (one walk of its layers) when the image is lazy and each lies in a
    small layer; None: pull them whole."""
    if parse_ref(ref).transport != "docker" or policy == "Never":
        return None  # local images cost nothing to read whole; Never is the pull's to refuse in its words
    hits = {path: cached(cache, ref, path, platform, policy, disk=False) for path in paths}
    if all(hits.values()):
        return hits
    shown = qualified(str(parse_ref(ref)), registry)
    with open_source(shown, registry) as source:
        enforce_source(source, TrustOptions(), registry, platform)  # the policy first: before any layer is read
        image = source.image(platform)
        if not lazytoc.marked(image.manifest, image.layers):
            return None
        try:
            walked = imagewalk.walk(image, lambda desc: BlobRanges(source.registry, source.name.repository, desc.digest, desc.size), shown)
        except imagewalk.NotSeekable as exc:
            notes.append(f"{exc.line()}; pulling it whole")
            return None
        located = {}
        for path in paths:
            found = locate(walked.tree, path)
            blocking = walked.tree.findings + found.problems
            if found.node is None or blocking:
                raise DiskkitError(shown, "; ".join(blocking) or f"{found.shown}: not found in the image")
            data = walked.pinned_file(found.node.layer, found.node.path, f"{shown}: layer {found.node.layer}")
            if data is None:
                notes.append(f"{shown}: nothing but its layer's whole digest verifies {found.shown} (no digest in a lazy TOC); pulling it whole")
                return None
            located[path] = (found.node, data)
        out = {path: _install(cache, image, shown, path, node, data, platform) for path, (node, data) in located.items()}
        remember(cache, shown, platform, image)
    return out


def _install(cache: Cache, image, shown: str, path: str, node, data: bytes, platform: Platform | None) -> Pulled:
    """Where `launcher pull` installs a file: keyed (layer, member), with the ref record it writes."""
    layer = image.layers[node.layer].digest
    with cache.staging() as spool:
        staged = spool / "file"
        write_atomic(staged, data)
        final = cache.install_disk(staged, layer, node.path, {"layer": layer, "member": node.path, "format": None, "virtual_size": None})
    pulled = Pulled(final, None, None, shown, image.digest, layer, node.path)
    cache.write_json(cache.ref_path(image_key(image.digest, path, platform, disk=False)), pulled.to_json())
    return pulled
