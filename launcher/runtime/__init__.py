"""Running VMs: the libvirt connection, the KVM probe, host CPU facts, the serial
console, the virtiofsd of each filesystem, run/stop/ls, garbage collection of what no running VM
uses, and PID 1's reaping in a container. The imperative shell around spec, volumes and render."""
