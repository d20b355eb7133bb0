"""The node cache and what goes into it: where pulled disks, overlays and VM records live,
the locks writers take turns with, and pulls (one streaming pass, verified, checked before use).
Owns the cache's layout; knows nothing of VMs beyond their records."""
