"""The node's lazy disk server: a read-only NBD server, the chunk store that reads a disk at offsets
from its registry blob (found in the image's layers by imagewalk), the control protocol, the client
`launcher run` uses, and kernelBoot files read out of a lazy image's small layers.
It serves disks into the node cache and never starts or stops VMs."""
