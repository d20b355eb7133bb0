"""Media types of the OCI image spec and Docker's schema2, and what each layer type means."""

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_NONDIST_GZIP = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_ZSTD = "application/vnd.docker.image.rootfs.diff.tar.zstd"

MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_LIST)

_LAYER_COMPRESSION = {
    OCI_LAYER: "none",
    OCI_LAYER_GZIP: "gzip",
    OCI_LAYER_ZSTD: "zstd",
    OCI_LAYER_NONDIST_GZIP: "gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar": "none",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd": "zstd",
    DOCKER_LAYER: "none",
    DOCKER_LAYER_GZIP: "gzip",
    DOCKER_LAYER_ZSTD: "zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": "gzip",
}


def layer_compression(media_type: str) -> str | None:
    """'gzip', 'zstd' or 'none' for a layer media type; None when it is not a layer we can read."""
    return _LAYER_COMPRESSION.get(media_type)


def oci_layer(compression: str) -> str:
    return {"gzip": OCI_LAYER_GZIP, "zstd": OCI_LAYER_ZSTD, "none": OCI_LAYER}[compression]


def docker_layer(compression: str) -> str:
    return {"gzip": DOCKER_LAYER_GZIP, "zstd": DOCKER_LAYER_ZSTD, "none": DOCKER_LAYER}[compression]
