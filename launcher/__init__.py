"""launcher: the runtime side of diskkit — pull containerDisks into a node cache and boot VMs from them."""
