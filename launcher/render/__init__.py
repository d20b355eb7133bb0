"""spec + resolved disks -> libvirt domain XML, as KubeVirt's converter renders it, and
dedicated CPU placement. Pure functions with golden tests: render never touches the filesystem,
libvirt or the network; what it needs to know of the host is passed in."""
