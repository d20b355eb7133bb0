"""Running VMs: the libvirt connection, the KVM probe, host CPU facts, the serial
console, the virtiofsd of each filesystem, run/stop/ls, and garbage collection of what no running
VM uses. The imperative shell around spec, volumes and render."""
