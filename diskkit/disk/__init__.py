"""Disks and KubeVirt's rules for them: qemu-img under limits, a disk's header read without
letting qemu open anything, what makes a disk usable, and where KubeVirt finds it in an image."""
