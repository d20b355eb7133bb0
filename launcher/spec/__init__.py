"""The objects a user gives the launcher, as KubeVirt and CDI read them: VMIs and VMs with
KubeVirt's defaulting and validation, instance types and preferences applied to VMs, DataVolumes, and
the Kubernetes objects around them (claims, PVs, ConfigMaps, Secrets) from manifests or the API
server. Parses and validates; never writes."""
