"""Multus networks whose NetworkAttachmentDefinition is a bridge CNI config: the NAD read as the bridge
plugin reads it (containernetworking/plugins plugins/main/bridge/bridge.go NetConf, loadNetConf), the
NIC rendered as KubeVirt renders a bridge-binding secondary interface
(pkg/virt-launcher/virtwrap/converter/network/configurator.go tapBindingOptions,
pkg/network/domainspec/generators.go TapLibvirtSpecGenerator, pkg/network/link/names.go,
pkg/network/namescheme/networknamescheme.go), and what a root launcher makes on the node for it: the
bridge and the VM's taps, made and removed in a network namespace of the test's own (tests/netns.py).
The guest on such a network, booted, is test_launcher_console's root boot."""

from __future__ import annotations

import hashlib
import json
import xml.etree.ElementTree as ET

import pytest
import yaml

from launcher.network import linuxbridge
from launcher.render.domain import Host, render
from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.multus import BridgeNetwork
from launcher.spec.vmi import parse_vmi
from tests.netns import NetNS

NAD = "NetworkAttachmentDefinition"
VM_UID = 1001 * 65536 + 107  # a VM's own uid as launcher.runtime.vmuser gives them: no process has it
OTHER_UID = 1002 * 65536 + 107


def nad(config: dict | str, name: str = "br-net", namespace: str = "default") -> dict:
    return {"apiVersion": "k8s.cni.cncf.io/v1", "kind": NAD, "metadata": {"name": name, "namespace": namespace},
            "spec": {"config": config if isinstance(config, str) else json.dumps(config)}}


def vmi(*interfaces: dict, networks: list | None = None) -> dict:
    """A VMI with `interfaces`; each not named default is on the Multus network br-net."""
    nets = networks if networks is not None else [{"name": i["name"], **({"pod": {}} if i["name"] == "default" else {"multus": {"networkName": "br-net"}})}
                                                  for i in interfaces]
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "v"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"interfaces": list(interfaces)}},
                     "networks": nets}}


BRIDGE = {"cniVersion": "0.3.1", "name": "br-net", "type": "bridge", "bridge": "br1"}  # tests/libnet/netattachdef.go NewBridgeNetAttachDef


def parsed(doc: dict, config: dict | str = BRIDGE):
    return parse_vmi(doc, objects=Objects([nad(config)]))


def refusal(doc: dict, config: dict | str = BRIDGE) -> str:
    with pytest.raises(SpecError) as err:
        parsed(doc, config)
    return err.value.line()


# --- the NAD, as the plugin reads it ---------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    (BRIDGE, BridgeNetwork("default/br-net", "spec.networks[0]", "br1", 1500)),
    # bridge.go: defaultBrName; tests/libnet WithMTU; the plugin's own flags
    ({"type": "bridge"}, BridgeNetwork("default/br-net", "spec.networks[0]", "cni0", 1500)),
    ({**BRIDGE, "mtu": 9000, "hairpinMode": True, "promiscMode": True, "portIsolation": True, "macspoofchk": True},
     BridgeNetwork("default/br-net", "spec.networks[0]", "br1", 9000, True, True, True, None, True, True)),
    # a conflist runs its first plugin; loadNetConf: runtimeConfig.mac wins over args.cni.mac
    ({"cniVersion": "1.0.0", "name": "n", "plugins": [{**BRIDGE, "args": {"cni": {"mac": "02:00:00:00:00:01"}},
                                                       "runtimeConfig": {"mac": "02:AA:00:00:00:02"}}, {"type": "tuning"}]},
     BridgeNetwork("default/br-net", "spec.networks[0]", "br1", 1500, mac="02:aa:00:00:00:02")),
    # "ipam": {} runs no IPAM plugin: the pod interface has no address, KubeVirt serves no DHCP (IPAMDisabled)
    ({**BRIDGE, "ipam": {}, "vlan": 0, "disableContainerInterface": True, "enabledad": True},
     BridgeNetwork("default/br-net", "spec.networks[0]", "br1", 1500)),
])
def test_a_bridge_nad_is_read_as_the_bridge_plugin_reads_it(config, expected):
    [iface] = parsed(vmi({"name": "sec", "bridge": {}}), config).domain.devices.interfaces
    assert iface.network == expected and not iface.on_pod_network


@pytest.mark.parametrize("key, value, why", [
    ("vlan", 100, "VLAN tagging on the bridge port"),
    ("vlanTrunk", [{"id": 101}], "VLAN trunks on the bridge port"),
    # pkg/network/dhcp/bridge.go: the address an IPAM plugin gives the pod interface goes to the guest by DHCP
    ("ipam", {"type": "host-local", "subnet": "10.250.250.0/24"}, "an IPAM plugin's address, which KubeVirt hands the guest by DHCP"),
    ("isGateway", True, "the gateway address on the bridge, from an IPAM plugin"),
    ("ipMasq", True, "masquerading the network's traffic (iptables rules)"),
])
def test_what_the_launcher_does_not_do_is_refused_in_one_line_naming_the_field(key, value, why):
    assert refusal(vmi({"name": "sec", "bridge": {}}), {**BRIDGE, key: value}) == \
        f"{NAD} default/br-net spec.config {key}: {why}: not supported by the launcher"


@pytest.mark.parametrize("name, why", [
    ("b" * 16, "is 16 bytes long; a network device's name has at most 15 (IFNAMSIZ)"),
    ("br\u00e9" * 4, "is 16 bytes long; a network device's name has at most 15 (IFNAMSIZ)"),  # 12 characters, 16 bytes
    ("../../lo", "is not a network device name (letters, digits, '_', '.' and '-', not first)"),
    ("..", "is not a network device name (letters, digits, '_', '.' and '-', not first)"),
    ("-help", "is not a network device name (letters, digits, '_', '.' and '-', not first)"),
    ("br 1", "is not a network device name (letters, digits, '_', '.' and '-', not first)"),
    ("br:1", "is not a network device name (letters, digits, '_', '.' and '-', not first)"),
    ("", "is empty"),
])
def test_a_bridge_name_root_would_not_make_is_refused_before_anything_runs(netns, name, why):
    """The NAD's author names the device root makes: its length is bounded by IFNAMSIZ and it can be
    neither a path nor an option of `ip` (docs/security.md)."""
    assert refusal(vmi({"name": "sec", "bridge": {}}), {**BRIDGE, "bridge": name}) == f"{NAD} default/br-net spec.config bridge: {name!r} {why}"
    # and root's own entry refuses it too, before any `ip` runs (a name that got past the spec); in the
    # test's namespace all the same, so that a check that fails touches nothing of the host's
    done = netns.python(ENSURE, name)
    assert done.stdout.strip() == f"{NAD} default/br-net spec.config bridge: {name!r} {why}", done.stderr
    assert list(netns.links()) == ["lo"]


def test_a_fifteen_byte_name_is_a_name():
    [iface] = parsed(vmi({"name": "sec", "bridge": {}}), {**BRIDGE, "bridge": "b" * 15}).domain.devices.interfaces
    assert iface.network.bridge == "b" * 15


def test_the_bridge_binding_alone_and_the_nads_mac_checked():
    # pkg/network/admitter/binding.go: KubeVirt's own refusal of masquerade off the pod network comes first
    assert refusal(vmi({"name": "sec", "masquerade": {}})) == "spec.domain.devices.interfaces[0].name: Masquerade interface only implemented with pod network"
    assert refusal(vmi({"name": "sec", "binding": {"name": "passt"}})) == \
        "spec.domain.devices.interfaces[0].binding: interface sec is on default/br-net, a bridge CNI network: the launcher gives it the bridge binding alone"
    assert refusal(vmi({"name": "sec", "bridge": {}}), {**BRIDGE, "args": {"cni": {"mac": "nope"}}}) == \
        f"{NAD} default/br-net spec.config: invalid MAC address nope"


# --- the domain, as KubeVirt renders it -------------------------------------------------------------

def canonical(element: ET.Element) -> str:
    """The element as one line: the domain's indentation left out."""
    for node in element.iter():
        node.text = (node.text or "").strip() or None
        node.tail = None
    return ET.tostring(element, encoding="unicode")


def interfaces_of(xml: str) -> list[ET.Element]:
    return ET.fromstring(xml).find("devices").findall("interface")


def test_a_secondary_bridge_nic_renders_as_kubevirts_tap_binding():
    doc = vmi({"name": "default", "masquerade": {}},
              {"name": "sec", "bridge": {}, "macAddress": "02:00:00:4B:4D:01", "pciAddress": "0000:01:05.0", "bootOrder": 2, "state": "down"},
              {"name": "third", "bridge": {}})
    v = parsed(doc, {**BRIDGE, "mtu": 1400})
    xml = render(v, {}, Host(net_dir="/run/vm/net", taps=(("sec", "dk3e9006bn0", "02:00:00:4b:4d:01"), ("third", "dk3e9006bn1", "0a:11:22:33:44:55"))))
    pod, sec, third = interfaces_of(xml)
    assert pod.get("type") == "user"
    # tapBindingOptions: ethernet; TapLibvirtSpecGenerator: the spec's MAC (else the pod interface's), its
    # MTU, target managed='no'; builder.go: alias ua-NAME, boot order (no rom element then), link down, PCI address
    assert canonical(sec) == (
        '<interface type="ethernet"><mac address="02:00:00:4b:4d:01" /><target dev="dk3e9006bn0" managed="no" /><mtu size="1400" />'
        '<model type="virtio-non-transitional" /><alias name="ua-sec" /><boot order="2" /><link state="down" />'
        '<address type="pci" domain="0x0000" bus="0x01" slot="0x05" function="0x0" /></interface>')
    assert third.find("mac").get("address") == "0a:11:22:33:44:55" and third.find("rom").get("enabled") == "no"
    # the pod NIC still gets its pod switch's first socket: the bridge NICs take none
    assert "addr.path=/run/vm/net/0.sock" in xml and "/run/vm/net/1.sock" not in xml
    assert [d.get("alias") for d in ET.fromstring(xml).iter("{http://libvirt.org/schemas/domain/qemu/1.0}device")] == ["ua-default"]


def test_without_the_launchers_taps_the_domain_names_kubevirts_in_pod_tap():
    """`launcher domain` makes no tap: the name KubeVirt's pod has, tap + sha256(network name)[:11]
    (names.go GenerateTapDeviceName, namescheme.go GenerateHashedInterfaceName); tap0 for Multus' default network."""
    [sec] = interfaces_of(render(parsed(vmi({"name": "sec", "bridge": {}})), {}, Host()))
    assert sec.find("target").attrib == {"dev": "tap" + hashlib.sha256(b"sec").hexdigest()[:11], "managed": "no"}
    assert sec.find("mac") is None and sec.find("mtu").get("size") == "1500"
    primary = vmi({"name": "sec", "bridge": {}}, networks=[{"name": "sec", "multus": {"networkName": "br-net", "default": True}}])
    [sec] = interfaces_of(render(parsed(primary), {}, Host()))
    assert sec.find("target").get("dev") == "tap0"


def test_an_absent_interface_is_no_device():
    # configurator.go Configure: FilterInterfacesSpec drops state absent
    v = parsed(vmi({"name": "sec", "bridge": {}, "state": "absent"}))
    assert v.domain.devices.interfaces == () and interfaces_of(render(v, {}, Host())) == []


def test_each_nic_gets_a_tap_of_the_vms_uid_and_a_mac():
    v = parsed(vmi({"name": "a", "bridge": {}, "macAddress": "02:00:00:00:00:0a"}, {"name": "b", "bridge": {}}))
    (a, tap_a, mac_a), (b, tap_b, mac_b) = linuxbridge.plan(v, VM_UID)
    assert (a, tap_a, mac_a, b, tap_b) == ("a", f"dk{VM_UID:x}n0", "02:00:00:00:00:0a", "b", f"dk{VM_UID:x}n1")
    # eth_random_addr: unicast, locally administered
    first = int(mac_b.split(":")[0], 16)
    assert first & 0x01 == 0 and first & 0x02 and mac_b != linuxbridge.plan(v, VM_UID)[1][2]
    assert len(linuxbridge.tap_name(1024 * 65536 + 107, 999).encode()) <= 15


# --- on the node: a network namespace of the test's own ----------------------------------------------

ENSURE = """
import sys
from launcher.network import linuxbridge
from launcher.spec.multus import BridgeNetwork
try:
    linuxbridge.ensure_bridge(BridgeNetwork("default/br-net", "spec.networks[0]", sys.argv[1], 1500))
    print("made")
except Exception as exc:
    print(exc)
"""

MAKE = """
import json, sys
from launcher.network import linuxbridge
from launcher.render.domain import network_queues
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
vmi = parse_vmi(json.loads(sys.argv[1]), objects=Objects(json.loads(sys.argv[2])))
uid = int(sys.argv[3])
try:
    taps = linuxbridge.plan(vmi, uid)
    print(json.dumps({"made": linuxbridge.make(vmi, taps, uid, network_queues(vmi))}))
except Exception as exc:
    print(json.dumps({"refused": str(exc)}))
"""

REMOVE = """
import json, sys
from launcher.network import linuxbridge
print(json.dumps(linuxbridge.remove_taps(int(sys.argv[1]))))
"""


@pytest.fixture
def netns():
    ns = NetNS()
    try:
        yield ns
    finally:
        ns.close()


def make_in(ns: NetNS, doc: dict, config: dict, uid: int = VM_UID) -> dict:
    done = ns.python(MAKE, json.dumps(doc), json.dumps([nad(config)]), str(uid))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_bridge_is_made_and_each_tap_is_the_vms_uids_on_it_until_the_uid_is_given_back(netns):
    doc = vmi({"name": "a", "bridge": {}}, {"name": "b", "bridge": {}})
    made = make_in(netns, doc, {**BRIDGE, "bridge": "br-made", "mtu": 1400, "hairpinMode": True, "portIsolation": True})
    taps = [f"dk{VM_UID:x}n0", f"dk{VM_UID:x}n1"]
    assert made == {"made": taps}
    links = netns.links()
    bridge = links["br-made"]
    # bridge.go ensureBridge: made with the config's MTU, up
    assert bridge["linkinfo"]["info_kind"] == "bridge" and bridge["mtu"] == 1400 and "UP" in bridge["flags"]
    for tap in taps:
        link = links[tap]
        data = link["linkinfo"]["info_data"]
        # netpod.go bridgeBindingSpec: a tap of the VM's uid and gid, the pod interface's MTU, on the bridge
        assert (data["type"], data["user"], data["group"], data["multi_queue"]) == ("tap", VM_UID, VM_UID, False)
        assert (link["master"], link["mtu"], "UP" in link["flags"]) == ("br-made", 1400, True)
        port = link["linkinfo"]["info_slave_data"]
        assert (port["hairpin"], port["isolated"]) == (True, True)
    # the uid given back (launcher.runtime.vmuser): its taps go, another uid's stay, and so does the bridge,
    # as the plugin's DEL leaves it
    make_in(netns, vmi({"name": "c", "bridge": {}}), {**BRIDGE, "bridge": "br-made"}, uid=OTHER_UID)
    removed = netns.python(REMOVE, str(VM_UID))
    assert sorted(json.loads(removed.stdout)) == taps, removed.stderr
    left = netns.links()
    assert not set(taps) & set(left) and f"dk{OTHER_UID:x}n0" in left and "br-made" in left


def test_multiqueue_gives_a_virtio_nics_tap_a_queue_per_vcpu(netns):
    """network/virtio-queues.go NetworkQueuesCapacity: with networkInterfaceMultiqueue, a virtio NIC has a
    queue per vCPU (converter/network/configurator.go newVirtioDriver), which a tap made without
    IFF_MULTI_QUEUE refuses libvirt (netpod.go gives KubeVirt's tap the queues); an e1000 has one."""
    doc = vmi({"name": "a", "bridge": {}}, {"name": "b", "bridge": {}, "model": "e1000"})
    doc["spec"]["domain"]["devices"]["networkInterfaceMultiqueue"] = True
    doc["spec"]["domain"]["cpu"] = {"cores": 2}
    [a, b] = interfaces_of(render(parsed(doc), {}, Host()))
    assert a.find("driver").attrib == {"name": "vhost", "queues": "2"} and b.find("driver") is None
    assert make_in(netns, doc, BRIDGE) == {"made": [f"dk{VM_UID:x}n0", f"dk{VM_UID:x}n1"]}
    links = netns.links()
    assert [links[f"dk{VM_UID:x}n{i}"]["linkinfo"]["info_data"]["multi_queue"] for i in (0, 1)] == [True, False]


def test_a_tap_a_killed_vm_left_is_replaced_and_a_device_of_its_name_it_does_not_own_is_left_alone(netns):
    tap = f"dk{VM_UID:x}n0"
    netns.run("ip", "tuntap", "add", "dev", tap, "mode", "tap", "user", VM_UID, "group", VM_UID)  # what a killed run left
    assert make_in(netns, vmi({"name": "a", "bridge": {}}), BRIDGE) == {"made": [tap]}
    assert netns.links()[tap]["master"] == "br1"
    netns.run("ip", "link", "del", "dev", tap)
    netns.run("ip", "link", "add", "name", tap, "type", "bridge")  # not a tap of the uid: never deleted by root
    assert make_in(netns, vmi({"name": "a", "bridge": {}}), BRIDGE) == {"refused": f"network device {tap}: exists and is not a tap of uid {VM_UID}: left alone"}
    assert json.loads(netns.python(REMOVE, str(VM_UID)).stdout) == [] and netns.links()[tap]["linkinfo"]["info_kind"] == "bridge"


@pytest.mark.parametrize("name, kind", [("lo", "loopback"), ("eth7", "veth")])
def test_a_device_of_the_bridges_name_that_is_no_bridge_is_refused_and_left_alone(netns, name, kind):
    """A NAD naming the node's loopback or uplink as its bridge: bridge.go bridgeByName's words, and
    no tap put on it."""
    if kind == "veth":
        netns.run("ip", "link", "add", "name", name, "type", "veth", "peer", "name", f"{name}p")
    before = netns.links()
    got = make_in(netns, vmi({"name": "a", "bridge": {}}), {**BRIDGE, "bridge": name})
    assert got == {"refused": f'{NAD} default/br-net spec.config bridge: "{name}" already exists but is not a bridge'}
    assert netns.links().keys() == before.keys()


@pytest.mark.parametrize("scope", ["all", "br-local"])
def test_a_bridge_that_routes_to_the_loopback_is_refused(netns, scope):
    """With route_localnet on, the kernel delivers a frame for 127.0.0.0/8 that comes in on the bridge
    to the node's loopback services: a guest on the bridge would reach them (docs/security.md)."""
    netns.run("ip", "link", "add", "name", "br-local", "type", "bridge")
    netns.run("sysctl", "-q", "-w", f"net.ipv4.conf.{scope}.route_localnet=1")
    got = make_in(netns, vmi({"name": "a", "bridge": {}}), {**BRIDGE, "bridge": "br-local"})
    assert got == {"refused": f"{NAD} default/br-net spec.config bridge: br-local: net.ipv4.conf route_localnet is on,"
                              " so a guest on the bridge would reach this node's loopback: not used"}
    assert not [name for name in netns.links() if name.startswith("dk")]


SEND = """
import fcntl, json, os, select, struct, subprocess, sys
tap, bridge, last = sys.argv[1], sys.argv[2], sys.argv[-1]
fd = os.open("/dev/net/tun", os.O_RDWR)
fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", tap.encode(), 0x0002 | 0x1000))  # as qemu: TUNSETIFF, IFF_TAP | IFF_NO_PI

def received():
    shown = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", bridge], capture_output=True, text=True, check=True).stdout
    return json.loads(shown)[0]["stats64"]["rx"]["packets"]

def port_state():
    shown = subprocess.run(["ip", "-d", "-j", "link", "show", "dev", tap], capture_output=True, text=True, check=True).stdout
    return json.loads(shown)[0]["linkinfo"]["info_slave_data"]["state"]

# The bridge learns of the tap's carrier (qemu's, here this process's, open file) through the kernel's
# link watch, a moment later: frames before its port forwards are dropped whatever their MAC.
for _ in range(200):
    if port_state() == "forwarding":
        break
    select.select([], [], [], 0.05)
before = received()
for mac in sys.argv[3:]:
    for _ in range(3):  # broadcasts from `mac`, which the bridge passes up to itself
        os.write(fd, bytes.fromhex("ff" * 6 + mac.replace(":", "") + "88b5") + bytes(46))
# The tap's frames reach the bridge in order: once the last MAC's three are in, every earlier one that
# passed is too.
for _ in range(200):
    if received() - before >= 3:
        break
    select.select([], [], [], 0.05)
print(received() - before)
"""


def test_macspoofchk_drops_what_the_guest_sends_from_another_mac(netns):
    """The plugin's macspoofchk (pkg/link/spoofcheck.go): frames the guest sends from any MAC but its own
    never enter the bridge; a tap of a network without it passes them. Its rule goes with the tap."""
    tap, other = f"dk{VM_UID:x}n0", f"dk{OTHER_UID:x}n0"
    own, spoofed = "02:00:00:00:00:0a", "02:00:00:00:00:0b"
    assert make_in(netns, vmi({"name": "a", "bridge": {}, "macAddress": own}), {**BRIDGE, "macspoofchk": True}) == {"made": [tap]}
    assert make_in(netns, vmi({"name": "b", "bridge": {}}), BRIDGE, uid=OTHER_UID) == {"made": [other]}
    sent = netns.python(SEND, tap, "br1", spoofed, own)  # the guest's own last: 3 in, and 3 more had the spoofed passed
    assert sent.stdout.strip() == "3", sent.stderr
    sent = netns.python(SEND, other, "br1", spoofed)
    assert sent.stdout.strip() == "3", sent.stderr
    assert f"-i {tap} " in netns.run("ebtables", "-t", "nat", "-L", "PREROUTING").stdout
    assert json.loads(netns.python(REMOVE, str(VM_UID)).stdout) == [tap]
    assert "-i " not in netns.run("ebtables", "-t", "nat", "-L", "PREROUTING").stdout


OPEN_TAP = """
import fcntl, os, struct, sys
fd = os.open("/dev/net/tun", os.O_RDWR)
try:
    fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", sys.argv[1].encode(), 0x0002 | 0x1000))  # TUNSETIFF, IFF_TAP | IFF_NO_PI
    print("opened")
except OSError as exc:
    print(os.strerror(exc.errno))
"""


def test_only_the_vms_own_uid_opens_its_tap(netns):
    """Another VM's qemu (another uid) cannot take this VM's tap, and so its traffic (docs/security.md)."""
    tap = f"dk{VM_UID:x}n0"
    assert make_in(netns, vmi({"name": "a", "bridge": {}}), BRIDGE) == {"made": [tap]}
    assert netns.python(OPEN_TAP, tap, user=OTHER_UID, tun_mode=0o666).stdout.strip() == "Operation not permitted"
    assert netns.python(OPEN_TAP, tap, user=VM_UID, tun_mode=0o666).stdout.strip() == "opened"


CHECK = """
import json, sys
from launcher.network import linuxbridge
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
vmi = parse_vmi(json.loads(sys.argv[1]), objects=Objects(json.loads(sys.argv[2])))
try:
    linuxbridge.check(vmi, own_uid=True, session=sys.argv[3] == "session")
    print("accepted")
except Exception as exc:
    print(exc)
"""


@pytest.mark.parametrize("mode, daemon, expected", [
    (0o666, "session", "accepted"),
    # the system daemon opens the tap as root and hands qemu the file
    (0o600, "system", "accepted"),
    (0o600, "session", "/dev/net/tun: mode 0600: the VM's qemu, a uid of its own, cannot open its tap on default/br-net (KubeVirt's pod"
                       " gets /dev/net/tun from its device plugin; udev's default is 0666: chmod 0666 /dev/net/tun)"),
])
def test_a_tun_device_the_vms_uid_cannot_open_is_refused_before_anything_runs(netns, mode, daemon, expected):
    done = netns.python(CHECK, json.dumps(vmi({"name": "a", "bridge": {}})), json.dumps([nad(BRIDGE)]), daemon, tun_mode=mode)
    assert done.stdout.strip() == expected, done.stderr


def test_an_unprivileged_launcher_refuses_a_bridge_network_in_one_line(qemu_user):
    manifests = qemu_user.root / "bridge-manifests"  # the qemu user's to read (pytest's tmp_path is root's)
    manifests.mkdir()
    (manifests / "nad.yaml").write_text(yaml.safe_dump(nad(BRIDGE)))
    spec = qemu_user.root / "bridge-vmi.yaml"
    doc = vmi({"name": "sec", "bridge": {}})
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "disk": {"bus": "virtio"}}]
    doc["spec"]["volumes"] = [{"name": "root", "containerDisk": {"image": "127.0.0.1:9/nothing/here:v1"}}]
    spec.write_text(json.dumps(doc))
    refused = qemu_user.launcher("run", "--tls-verify=false", "--manifests", manifests, spec)
    assert refused.code == 1
    assert refused.err.strip().splitlines()[-1] == ("launcher: spec.networks[0].multus: NetworkAttachmentDefinition default/br-net is a"
                                                    " bridge CNI network: its bridge and taps are made by a root launcher alone (run it as root)")
