"""The node's lazy disk server: a read-only NBD server, the chunk store that reads a
disk at offsets from its registry blob, the control protocol, and the client `launcher run` uses.
It serves disks into the node cache and never starts or stops VMs."""
