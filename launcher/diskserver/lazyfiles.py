"""kernelBoot artifacts (firmware.kernelBoot.container) out of a lazy image, its disk layer never fetched whole.

A kernel and an initrd are small files a VM needs whole before it starts, so they are not served:
the node's disk server takes them out of the layers as imagewalk reads them, each checked before it
is used (a small layer read whole against its digest and diffID; a file in the lazy layer, in the
members around the disk's, against its digest in the TOC's `files`), and installs them in the node
cache as `launcher pull` installs them (the same ref record, so later pulls and runs find them).
The members around a disk it already exports are read from that export, not fetched again. A file
nothing but the whole blob's digest would vouch for (a TOC written before `files`) is pulled whole.
"""

from __future__ import annotations

from typing import Callable

from diskkit.disk.containerdisk import locate
from diskkit.errors import DiskkitError
from diskkit.oci.image import Descriptor, Image, Platform
from diskkit.streams.fsutil import write_atomic
from launcher.diskserver import imagewalk
from launcher.node.cache import Cache
from launcher.node.pull import Pulled, image_key, remember


def take_files(cache: Cache, image: Image, shown: str, paths: list[str], platform: Platform | None,
               ranges_for: Callable[[Descriptor], imagewalk.Ranges], source) -> dict[str, Pulled]:
    """The files at `paths`, installed; NotSeekable when one of them must come from a whole pull.
    `source` is what the image was read from: its record says how the read got in (launcher.node.pull.remember)."""
    walked = imagewalk.walk(image, ranges_for, shown)
    taken = {}
    for path in paths:
        found = locate(walked.tree, path)
        blocking = walked.tree.findings + found.problems
        if found.node is None or blocking:
            raise DiskkitError(shown, "; ".join(blocking) or f"{found.shown}: not found in the image")
        data = walked.pinned_file(found.node.layer, found.node.path, f"{shown}: layer {found.node.layer}")
        if data is None:
            raise imagewalk.NotSeekable(shown, f"nothing but its layer's whole digest verifies {found.shown} (no digest in a lazy TOC)")
        taken[path] = (found.node, data)
    out = {path: _install(cache, image, shown, path, node, data, platform) for path, (node, data) in taken.items()}
    remember(cache, shown, platform, image, source)
    return out


def _install(cache: Cache, image: Image, shown: str, path: str, node, data: bytes, platform: Platform | None) -> Pulled:
    """Where `launcher pull` installs a file: keyed (layer, member), with the ref record it writes."""
    layer = image.layers[node.layer].digest
    with cache.staging() as spool:
        staged = spool / "file"
        write_atomic(staged, data)
        final = cache.install_disk(staged, layer, node.path, {"layer": layer, "member": node.path, "format": None, "virtual_size": None})
    pulled = Pulled(final, None, None, shown, image.digest, layer, node.path)
    cache.write_json(cache.ref_path(image_key(image.digest, path, platform, disk=False)), pulled.to_json())
    return pulled
