"""Whether an image is for the guest the launcher renders: a containerDisk built for another
architecture would be booted by an x86_64 q35 domain that cannot run it, so it is refused, naming the
image's platform and the host's.

KubeVirt never meets this: the kubelet pulls the node's platform from an index, and a VMI's
spec.architecture picks the node. Here `--platform` picks from an index, and a single-platform image
is whatever it was built for: both are checked against the guest (amd64: the only architecture the
launcher renders, launcher.spec.vmi), before a layer is read where the pull allows it.
"""

from __future__ import annotations

import shutil

from diskkit.errors import DiskkitError
from diskkit.oci.image import Platform
from launcher.node.cache import Cache
from launcher.node.pull import Pulled, cached_config

# GOARCH -> qemu's system emulator suffix.
EMULATORS = {"amd64": "x86_64", "386": "i386", "arm64": "aarch64", "arm": "arm", "ppc64le": "ppc64", "s390x": "s390x", "riscv64": "riscv64"}


def guest() -> Platform:
    return Platform("linux", "amd64")


def _why(plat: Platform) -> str:
    emulator = f"qemu-system-{EMULATORS.get(plat.architecture, plat.architecture)}"
    have = "is installed, but the launcher renders amd64 (x86_64 q35) guests only" if shutil.which(emulator) else "is not installed"
    host = Platform.host()
    return f"this host runs {host} guests ({emulator}, which {plat} needs, {have})"


def check_requested(platform: Platform | None) -> None:
    """`--platform` naming another guest architecture: refused before anything is pulled."""
    if platform is not None and (platform.os, platform.architecture) != (guest().os, guest().architecture):
        raise DiskkitError(f"--platform {platform}", f"cannot boot an image for {platform}: {_why(platform)}")


def config_platform(config: dict) -> Platform | None:
    if not isinstance(config, dict) or not config.get("architecture"):
        return None
    return Platform(str(config.get("os") or "linux"), str(config["architecture"]), config.get("variant"))


def image_platform(cache: Cache, pulled: Pulled) -> Platform | None:
    """The os/architecture of the image a pull resolved to, from the manifest and config it remembered."""
    return config_platform(cached_config(cache, pulled))


def check_platform(plat: Platform | None, image: str) -> None:
    if plat is not None and (plat.os, plat.architecture) != (guest().os, guest().architecture):
        raise DiskkitError(image, f"image platform {plat} is not the guest's {guest()}: {_why(plat)}")


def check_config(image: str):
    """For a pull: the check made on the image's config before any layer is read."""
    return lambda config: check_platform(config_platform(config), image)


def check_image(cache: Cache, pulled: Pulled) -> None:
    """After a pull or a lazy attach (a cached disk, or one the disk server opened)."""
    check_platform(image_platform(cache, pulled), pulled.image)
