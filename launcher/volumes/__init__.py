"""A VMI's volumes made real, one module per kind: containerDisks (pulled, served lazily, or found
in the pod's image volumes, under per-VM overlays), claims, emptyDisk and hostDisk, the generated
cloud-init, config and metrics disks, and the directories virtiofs filesystems share. Writes only
in the VM's run directory, claims and the cache (image volumes are only read); never talks to libvirt."""
