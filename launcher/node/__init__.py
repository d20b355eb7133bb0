"""The node cache and what goes into it: where pulled disks, overlays and VM records live,
the locks writers take turns with, pulls (one streaming pass, verified, checked before use), and the
digests a VirtualMachine's tags are pinned to. Owns the cache's layout; knows nothing of VMs beyond
their records and pins."""
