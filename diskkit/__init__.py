"""diskkit: package VM disks as OCI images (KubeVirt containerDisks) without a container engine."""

__version__ = "0.1.0"
