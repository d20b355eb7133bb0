"""Kubernetes objects read from the API server, for the launcher running in a pod (`--kube-api`).

The same `get(kind, namespace, name)` as `k8s.Objects`, so claims, PVs and secrets resolve the same
way whether they come from manifests or from the cluster. Objects are fetched as raw JSON (not the
client's models) so they have exactly the shape a manifest has; each is read once per launch.
"""

from __future__ import annotations

import json
import os

from diskkit.errors import DiskkitError
from launcher.spec.k8s import CLUSTER_SCOPED, DEFAULT_NAMESPACE, describe_object

# kind -> (API class, method, plural for custom objects)
_CORE = {
    "PersistentVolumeClaim": "read_namespaced_persistent_volume_claim",
    "PersistentVolume": "read_persistent_volume",
    "Secret": "read_namespaced_secret",
    "ConfigMap": "read_namespaced_config_map",
    "ServiceAccount": "read_namespaced_service_account",
}
_CUSTOM = {
    "DataVolume": ("cdi.kubevirt.io", "v1beta1", "datavolumes"),
    "DataSource": ("cdi.kubevirt.io", "v1beta1", "datasources"),
    "VolumeSnapshot": ("snapshot.storage.k8s.io", "v1", "volumesnapshots"),
    "VirtualMachineInstancetype": ("instancetype.kubevirt.io", "v1beta1", "virtualmachineinstancetypes"),
    "VirtualMachinePreference": ("instancetype.kubevirt.io", "v1beta1", "virtualmachinepreferences"),
    "VirtualMachineClusterInstancetype": ("instancetype.kubevirt.io", "v1beta1", "virtualmachineclusterinstancetypes"),
    "VirtualMachineClusterPreference": ("instancetype.kubevirt.io", "v1beta1", "virtualmachineclusterpreferences"),
    "NetworkAttachmentDefinition": ("k8s.cni.cncf.io", "v1", "network-attachment-definitions"),  # launcher.spec.multus
}


class ClusterObjects:
    """Objects from the API server: in a pod through its service account, elsewhere through kubeconfig."""

    def __init__(self, kubeconfig: str | None = None):
        try:
            from kubernetes import client, config
        except ImportError:
            raise DiskkitError("--kube-api", "needs the kubernetes package (pip install 'diskkit[launcher]')") from None
        try:
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=kubeconfig)
        except config.ConfigException as err:
            raise DiskkitError("--kube-api", f"no Kubernetes API to talk to: {err}") from None
        self._client = client
        self._api = client.ApiClient()
        self._host = self._api.configuration.host
        self._seen: dict[tuple[str, str | None, str], dict | None] = {}

    def _read(self, kind: str, namespace: str | None, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        args = (name,) if namespace is None else (name, namespace)
        try:
            if kind in _CORE:
                response = getattr(self._client.CoreV1Api(self._api), _CORE[kind])(*args, _preload_content=False)
            elif kind == "StorageClass":
                response = self._client.StorageV1Api(self._api).read_storage_class(name, _preload_content=False)
            elif kind in _CUSTOM:
                group, version, plural = _CUSTOM[kind]
                api = self._client.CustomObjectsApi(self._api)
                if namespace is None:
                    response = api.get_cluster_custom_object(group, version, plural, name, _preload_content=False)
                else:
                    response = api.get_namespaced_custom_object(group, version, namespace, plural, name, _preload_content=False)
            else:
                raise DiskkitError(describe_object(kind, namespace, name), "the launcher does not read this kind from the API")
        except ApiException as err:
            if err.status == 404:
                return None
            # The reason only: the body of a denied request may quote the object.
            raise DiskkitError(describe_object(kind, namespace, name), f"the Kubernetes API at {self._host} answered {err.status} {err.reason}") from None
        except HTTPError as err:
            raise DiskkitError(describe_object(kind, namespace, name), f"cannot reach the Kubernetes API at {self._host}: {type(err).__name__}") from None
        return json.loads(response.data)

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        key = (kind, None if kind in CLUSTER_SCOPED else namespace or DEFAULT_NAMESPACE, name)
        if key not in self._seen:
            self._seen[key] = self._read(*key)
        return self._seen[key]

    # Listing (every Secret of a namespace to find a token, every PV to find one reserved for a claim,
    # every StorageClass for the default) needs rights a launcher should not hold: in a pod the
    # token is the mounted one, and claims are found through their own binding.
    def of_kind(self, kind: str, namespace: str | None) -> list[dict]:
        return []

    def documents(self, kind: str) -> list[tuple[str, dict]]:
        return []
