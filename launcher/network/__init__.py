"""The guest's network: the room every pod-network NIC goes through. One plug-in per interface binding
(masquerade, bridge, the passt binding plugin) says what the guest is given (bindings); each NIC's
pod switch (switch) sits between qemu and the user-mode stacks (passt) and judges every frame the guest
sends (guard), so that no guest reaches the host's loopback or another VM's forwards; backend starts
and stops the switches, forward is `launcher port-forward`'s side. The device XML is launcher.render's.
The pod network never touches the host's bridges, taps or firewall; a Multus bridge network is, by the
user's choice, a Linux bridge of the host's, where linuxbridge (root) puts each NIC's tap."""
