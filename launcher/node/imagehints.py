"""The instance type and preference hints of a containerDisk's image, for `inferFromVolume` naming a
containerDisk (KubeVirt refuses that; here the image's own config answers, as it would on a claim
CDI imported from it).

Only the manifest and config are read, after the signature policy has passed, with the node's
credentials (a volume's imagePullSecret is not consulted for this read) and the platform the run
uses; the disk itself is pulled later as for any containerDisk.
"""

from __future__ import annotations

from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions


class ImageHints:
    """An object source (launcher.spec.instancetype.ObjectSource) that also reads images' hint labels."""

    def __init__(self, objects, registry: RegistryOptions | None, platform: Platform | None):
        self.objects = objects
        self.registry = registry
        self.platform = platform
        self._seen: dict[str, dict[str, str]] = {}

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.objects.get(kind, namespace, name) if self.objects is not None else None

    def image_labels(self, image: str) -> dict[str, str]:
        # Imported here: only a VM inferring from a containerDisk needs the registry client.
        from diskkit.oci import hints
        from diskkit.oci.reference import parse_ref
        from launcher.node.admission import admitted

        shown = str(parse_ref(image))
        if shown not in self._seen:
            with admitted(shown, self.registry, self.platform) as source:
                self._seen[shown] = hints.from_config(source.image(self.platform).config)
        return self._seen[shown]
