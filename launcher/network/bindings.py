"""One plug-in per interface binding, keyed by the binding's name as KubeVirt's pkg/network keys its
own (pkg/network/setup/netpod/netpod.go: masqueradeBindingSpec, bridgeBindingSpec, and the passt
binding plugin, cmd/sidecars/network-passt-binding): what the guest is given on the pod network and
how the launcher's stack gives it (pure).

Every binding is served by passt (Debian's), a user-mode stack that needs no privilege, no bridge, tap
or firewall rule on the host, and hands out addresses itself (DHCP, DHCPv6, NDP), behind the
launcher's pod switch (launcher.network.switch), which judges every frame the guest sends
(launcher.network.guard). What differs is what the guest gets:

- masquerade: KubeVirt's own addresses, the 2nd address of vmNetworkCIDR (10.0.2.2/24) via the 1st
  (10.0.2.1), and fd10:0:2::2 via fd10:0:2::1 of vmIPv6NetworkCIDR where the pod has IPv6
  (netpod.go, pkg/network/dhcp/masquerade.go); DHCPv6 and no router advertisement, as KubeVirt's
  in-pod servers give them (examples/vmi-masquerade.yaml writes the IPv6 route itself). The DNS
  server is the gateway, where the switch forwards to the pod's resolver: KubeVirt hands the pod's
  resolv.conf servers, which on a laptop are often a loopback resolver (127.0.0.53) a guest cannot use.
- bridge: the guest takes the pod's address (here, the launcher's network namespace's: the host's
  on a laptop, see launcher.network.pod), its gateway and its MTU, by DHCPv4 as KubeVirt's bridge
  DHCP server hands the pod's cached IPv4 (pkg/network/dhcp/bridge.go); IPv6 only where the pod has
  no IPv4.
- passt (the binding plugin): the pod's addresses as passt gives them, IPv4 and IPv6, with its
  router advertisements (what libvirt's passt backend does for KubeVirt's sidecar).
For bridge and passt the DNS servers are the pod's resolv.conf's, unless one is on the loopback: then
the gateway forwards to it, as for masquerade. (passt's own --dns-forward, in Debian 12's passt, sends
to the first server it advertises: the gateway itself. So the switch forwards.)

The gateway's MAC is KubeVirt's in-pod bridge's (pkg/network/link/mac.go StaticMasqueradeBridgeMAC)
for every binding: the switch answers for it and its forwards come from it.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import Callable, Optional

from diskkit.errors import DiskkitError
from launcher.network.guard import ENTRY, Policy
from launcher.network.pod import PodNet
from launcher.spec.fields import SpecError
from launcher.spec.network import RESERVED_MAC, Interface

GATEWAY_MAC = RESERVED_MAC


@dataclass(frozen=True)
class Plan:
    """One NIC: what its guest is given and the stack's options that give it."""

    interface: str
    binding: str
    guest4: Optional[ipaddress.IPv4Interface]
    gateway4: Optional[ipaddress.IPv4Address]
    guest6: Optional[ipaddress.IPv6Interface]
    gateway6: Optional[ipaddress.IPv6Address]
    dns: tuple[ipaddress._BaseAddress, ...]  # what DHCP and DHCPv6 hand out
    mtu: int
    policy: Policy
    stack: tuple[str, ...]  # passt's options for the guest's own traffic (no -F, -P: the switch adds them)
    online: bool  # the pod has a route out: the stack runs where the launcher does; else with the forwards'
    publish: tuple[tuple[str, int, str], ...] = ()  # (address, port, protocol) published on the pod's side
    publish_address: Optional[str] = None
    # where the switch sends the DNS queries the guest sends to the gateway: the pod's resolv.conf
    # servers; empty when the guest talks to them itself
    dns_upstream: tuple[ipaddress._BaseAddress, ...] = ()

    def forwards_stack(self) -> tuple[str, ...]:
        """passt's options for the stack of the launcher's forwards: the guest's addresses on one side;
        on the other one listener per protocol at ENTRY, in the switch's own network namespace,
        whose connections reach the guest's placeholder port 1 (launcher.network.guard.Forwards);
        no DHCP, NDP or router advertisement of its own."""
        if self.guest4 is not None:
            family = ["-4", "-a", str(self.guest4.ip), "-n", str(self.guest4.network.prefixlen), "-g", str(self.gateway4)]
        else:
            family = ["-6", "-a", str(self.guest6.ip), "-g", str(self.gateway6)]
        return (*family, "-M", GATEWAY_MAC, "-m", str(self.mtu), "--no-dhcp", "--no-ndp", "--no-dhcpv6", "--no-ra",
                "-t", f"{ENTRY}:1", "-u", f"{ENTRY}:1")


def _where(iface: Interface) -> str:
    return "spec.domain.devices.interfaces" if iface.index < 0 else f"spec.domain.devices.interfaces[{iface.index}]"


def _publish_options(publish: tuple[tuple[str, int, str], ...]) -> list[str]:
    return [opt for address, port, protocol in publish for opt in ("-t" if protocol == "TCP" else "-u", f"{address}/{port}:{port}")]


def _dns(nameservers, gateways) -> tuple[list[str], tuple, tuple]:
    """(passt's options, the servers handed out, where the gateway forwards): the pod's servers as they
    are, or the gateways, forwarding to them, when any is the pod's own loopback or there are none."""
    if not nameservers or any(ns.is_loopback for ns in nameservers):
        return [opt for gateway in gateways for opt in ("-D", str(gateway))], tuple(gateways), tuple(nameservers)
    return [opt for ns in nameservers for opt in ("-D", str(ns))], tuple(nameservers), ()


def _masquerade(iface: Interface, pod: PodNet, publish) -> Plan:
    # netpod.go masqueradeBindingSpec: each family the pod has; the gateway is the subnet's 1st host
    # address, the guest's its 2nd (pkg/network/link/address.go GenerateMasqueradeGatewayAndVmIPAddrs)
    net4, net6 = ipaddress.IPv4Network(iface.cidr), ipaddress.IPv6Network(iface.cidr6)
    online = pod.ipv4 is not None or pod.ipv6 is not None
    # With no route out the guest still gets its IPv4 address, so that forwards reach it.
    use4, use6 = pod.ipv4 is not None or not online, pod.ipv6 is not None
    guest4 = ipaddress.IPv4Interface(f"{net4[2]}/{net4.prefixlen}") if use4 else None
    guest6 = ipaddress.IPv6Interface(f"{net6[2]}/{net6.prefixlen}") if use6 else None
    gateway4, gateway6 = (net4[1] if use4 else None), (net6[1] if use6 else None)
    gateways = [g for g in (gateway4, gateway6) if g is not None]
    stack = ["--no-map-gw", "-M", GATEWAY_MAC, "-m", str(pod.mtu), "--no-ra"]
    if guest4:
        stack += ["-a", str(guest4.ip), "-n", str(net4.prefixlen), "-g", str(gateway4)]
    if guest6:
        stack += ["-a", str(guest6.ip), "-g", str(gateway6)]
    stack += ["-4"] if not use6 else ["-6"] if not use4 else []
    stack += [opt for gateway in gateways for opt in ("-D", str(gateway))]
    return Plan(iface.name, "masquerade", guest4, gateway4, guest6, gateway6, tuple(gateways), pod.mtu,
                Policy(gateway4, gateway6, net4 if use4 else None, net6 if use6 else None, dns_forwarder=True),
                (*stack, *_publish_options(publish)), online, publish, dns_upstream=pod.nameservers)


def _pod_address(iface: Interface, pod: PodNet, publish, families: str) -> Plan:
    if pod.ipv4 is None and pod.ipv6 is None:
        raise SpecError(f"{_where(iface)}.{'bridge' if iface.binding == 'bridge' else 'binding'}",
                        f"interface {iface.name} takes the pod's address, and the launcher's network (the pod's) has no default route:"
                        " give it masquerade to run without one")
    use4 = pod.ipv4 is not None
    use6 = pod.ipv6 is not None and (families == "both" or not use4)
    guest4, gateway4 = (pod.ipv4, pod.gateway4) if use4 else (None, None)
    guest6, gateway6 = (pod.ipv6, pod.gateway6) if use6 else (None, None)
    stack = ["--no-map-gw", "-M", GATEWAY_MAC, "-m", str(pod.mtu)]
    if guest4:
        stack += ["-a", str(guest4.ip), "-n", str(guest4.network.prefixlen), "-g", str(gateway4)]
    if guest6:
        stack += ["-a", str(guest6.ip), "-g", str(gateway6)]
    stack += ["-4"] if not use6 else ["-6"] if not use4 else []
    usable = [ns for ns in pod.nameservers if ns.is_loopback or (ns.version == 4 and use4) or (ns.version == 6 and use6)]
    dns_options, dns, upstream = _dns(usable, [g for g in (gateway4, gateway6) if g is not None])
    return Plan(iface.name, iface.binding, guest4, gateway4, guest6, gateway6, dns, pod.mtu,
                Policy(gateway4, gateway6, dns_forwarder=bool(upstream) or not usable),
                (*stack, *dns_options, *_publish_options(publish)), True, publish, dns_upstream=upstream)


BINDINGS: dict[str, Callable[[Interface, PodNet, tuple], Plan]] = {
    "masquerade": _masquerade,
    "bridge": lambda iface, pod, publish: _pod_address(iface, pod, publish, "ipv4"),
    "passt": lambda iface, pod, publish: _pod_address(iface, pod, publish, "both"),
}


def plan(iface: Interface, pod: PodNet, publish_address: Optional[str] = None) -> Plan:
    """The interface's plug-in's plan; `publish_address` publishes its declared ports there, as KubeVirt's
    masquerade and passt forward them from the pod's address."""
    if iface.mac == GATEWAY_MAC:
        # admitter: masquerade's own refusal (spec.network); the others' gateway has the same address here
        raise SpecError(f"{_where(iface)}.macAddress", "The requested MAC address is reserved for the in-pod bridge. Please choose another one.")
    publish = tuple((publish_address, port.port, port.protocol) for port in iface.ports) if publish_address else ()
    planned = replace(BINDINGS[iface.binding](iface, pod, publish), publish_address=publish_address)
    if publish and not planned.online:
        raise DiskkitError("--publish-address", f"interface {iface.name}'s ports cannot be published: the launcher's network (the pod's) has no default route")
    return planned
