"""kernelBoot artifacts (firmware.kernelBoot.container) out of a lazy image, its disk layer never fetched whole.

A kernel and an initrd are small files a VM needs whole before it starts, so they are not served:
they are read out of the image's small layers, which imagewalk fetches whole and checks against
their digest and diffID before a byte is used, and installed in the node cache as `launcher pull`
would install them (the same ref record, so later pulls and runs find them). A file in the lazy
layer itself lies outside the disk's chunks, where nothing short of the whole blob's digest vouches
for it: such an image is pulled whole, as any image that is not lazy.
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
        if lazytoc.ANNOTATION_LAZY not in (image.manifest.get("annotations") or {}):
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
            if not walked.verified(found.node.layer):
                notes.append(f"{shown}: {found.shown} is in layer {found.node.layer}, which only its whole digest verifies; pulling it whole")
                return None
            located[path] = found.node
        out = {path: _install(cache, walked, image, shown, path, node, platform) for path, node in located.items()}
        remember(cache, shown, platform, image)
    return out


def _install(cache: Cache, walked: imagewalk.Walked, image, shown: str, path: str, node, platform: Platform | None) -> Pulled:
    """Where `launcher pull` installs a file: keyed (layer, member), with the ref record it writes."""
    layer = image.layers[node.layer].digest
    with cache.staging() as spool:
        staged = spool / "file"
        write_atomic(staged, walked.file_bytes(node.layer, node.path))
        final = cache.install_disk(staged, layer, node.path, {"layer": layer, "member": node.path, "format": None, "virtual_size": None})
    pulled = Pulled(final, None, None, shown, image.digest, layer, node.path)
    cache.write_json(cache.ref_path(image_key(image.digest, path, platform, disk=False)), pulled.to_json())
    return pulled
