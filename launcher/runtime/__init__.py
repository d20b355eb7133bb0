"""Running VMs: the libvirt connection (and, for root with no system daemon, a session daemon of the qemu user for each VM, under
the VM's own uid), the disks root hands qemu open, the KVM probe, host CPU facts, the serial console (its log, and attaching to it), the virtiofsd of each filesystem, run/stop/ls, garbage collection of what no running VM
uses, and PID 1's reaping in a container. The imperative shell around spec, volumes and render."""
