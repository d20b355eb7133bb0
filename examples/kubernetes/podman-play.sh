#!/usr/bin/env bash
# Play this directory's VM pod (pod.yaml, configmap.yaml, secret.yaml, pvc.yaml) with rootful podman
# (4.3 or later), converted where podman is not a kubelet (README.md, "Under podman"); stop it with
# podman-down.sh.
#
#   podman-play.sh [--image REF] [--cache DIR] [--port PORT] [--tls-verify=false] [--launcher-image REF]
#
#   --image REF           the VMI's containerDisk, as this host reaches it (default: configmap.yaml's).
#                         A registry on this host's loopback (127.0.0.1, localhost) is 10.0.3.2 from the
#                         pod: the reference is rewritten, and only then may the pod reach the host's loopback.
#   --cache DIR           the node cache, pod.yaml's hostPath (default /var/lib/diskkit): a directory of 107's
#   --port PORT           the guest's port 80 (the pod's http port) on this host's 127.0.0.1:PORT
#   --tls-verify=false    the registry speaks plain HTTP
#   --launcher-image REF  the launcher's image in podman's store (default: localhost/diskkit-launcher:TAG,
#                         as images/launcher/build.sh names it, TAG being pod.yaml's)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
me=podman-play.sh
die() { echo "$me: $*" >&2; exit 1; }
usage() { sed -n 's/^#   //p' "$0" | head -n 1 >&2; exit 2; }

image="" cache=/var/lib/diskkit port="" tls_verify=true launcher_image=""
while [ $# -gt 0 ]; do
    case $1 in
        --image) image=${2:?--image needs a value}; shift 2 ;;
        --image=*) image=${1#*=}; shift ;;
        --cache) cache=${2:?--cache needs a value}; shift 2 ;;
        --cache=*) cache=${1#*=}; shift ;;
        --port) port=${2:?--port needs a value}; shift 2 ;;
        --port=*) port=${1#*=}; shift ;;
        --tls-verify=false) tls_verify=false; shift ;;
        --tls-verify=true) tls_verify=true; shift ;;
        --launcher-image) launcher_image=${2:?--launcher-image needs a value}; shift 2 ;;
        --launcher-image=*) launcher_image=${1#*=}; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d; s/^# \{0,1\}//; p}' "$0"; exit 0 ;;
        *) echo "$me: unknown argument $1" >&2; usage ;;
    esac
done
[[ -z $port || $port =~ ^[1-9][0-9]{0,4}$ ]] || die "--port $port: not a port number"

[ "$(id -u)" = 0 ] || die "run it as root: the pod is rootful podman's (the cache and the pod's network namespace are root's to set up)"
python3 -c 'import yaml' 2>/dev/null || die "needs python3 with PyYAML to convert the manifests (Debian: apt-get install python3-yaml)"
[ -d "$cache" ] || die "--cache $cache: no such directory; create the node cache once, 107's: install -d -o 107 -g 107 $cache"
[ "$(stat -c %u:%g "$cache")" = 107:107 ] ||
    die "--cache $cache: owned by $(stat -c %u:%g "$cache"), not 107:107 (the launcher runs as 107, and fsGroup does not reach a hostPath): chown 107:107 $cache"

work=$(mktemp -d "${TMPDIR:-/tmp}/podman-play.XXXXXX")
pod="" claim="" configmaps="" state=none made_claim=false
# What this run made goes again when the pod did not start: nothing half-played is left.
cleanup() {
    if [ "$state" = created ]; then
        podman pod rm --force "$pod" >/dev/null 2>&1 || true
        podman volume rm --force ${configmaps//,/ } >/dev/null 2>&1 || true
    fi
    if [ "$state" != started ] && [ "$made_claim" = true ]; then
        podman volume rm --force "$claim" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# The conversions. Prints: pod name, launcher container, claim, the ConfigMaps (podman makes a volume of
# each), launcher image, lowest declared port, whether the image is on this host's loopback; writes the
# playable manifests to $work/pod.yaml.
read -r pod container claim configmaps launcher_image lowest loopback < <(
python3 - "$here" "$work/pod.yaml" "$image" "$cache" "$port" "$tls_verify" "$launcher_image" <<'PY'
import base64, sys
from pathlib import Path
import yaml

here, out, image, cache, port, tls_verify, launcher_image = sys.argv[1:]
def load(name):
    return [d for d in yaml.safe_load_all((Path(here) / name).read_text()) if d]
def fail(message):
    sys.exit(f"podman-play.sh: {message}")

(configmap,), (pod,), secrets, (pvc,) = load("configmap.yaml"), load("pod.yaml"), load("secret.yaml"), load("pvc.yaml")

# The containerDisk, as the pod reaches it: the host's loopback is slirp4netns's 10.0.3.2 (the subnet below).
vmi = yaml.safe_load(configmap["data"]["vmi.yaml"])
disks = [v["containerDisk"] for v in vmi["spec"]["volumes"] if "containerDisk" in v]
if len(disks) != 1:
    fail(f"configmap.yaml: {len(disks)} containerDisks; --image replaces the one")
loopback = False
if image:
    host, _, rest = image.partition("/")
    name, _, port_part = host.partition(":")
    if rest and name in ("127.0.0.1", "localhost"):
        image, loopback = "10.0.3.2" + (":" + port_part if port_part else "") + "/" + rest, True
    disks[0]["image"] = image
configmap["data"]["vmi.yaml"] = yaml.safe_dump(vmi, sort_keys=False)
ports = [p["port"] for i in vmi["spec"]["domain"]["devices"].get("interfaces", []) for p in i.get("ports", [])]

# podman 4.3 crashes on a secret volume (and refuses a missing optional one): each Secret becomes a
# ConfigMap of the same data, mounted at the same place.
configmaps = [configmap]
for secret in secrets:
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    data.update(secret.get("stringData", {}))
    configmaps.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": secret["metadata"]["name"]}, "data": data})
spec = pod["spec"]
for volume in spec["volumes"]:
    if "secret" in volume:
        source = volume.pop("secret")
        volume["configMap"] = {"name": source.pop("secretName"), **source}
    if "hostPath" in volume:
        volume["hostPath"]["path"] = cache
(launcher,) = [c for c in spec["containers"] if c["name"] == "launcher"]
# kube play ignores imagePullSecrets: the image comes from podman's own store.
tag = launcher["image"].rpartition(":")[2]
launcher["image"] = launcher_image or f"localhost/diskkit-launcher:{tag}"
if tls_verify == "false":
    launcher["command"].append("--tls-verify=false")
if port:
    # kube play has no --publish: a hostPort is how it publishes a pod's port on the host.
    (http,) = [p for p in launcher["ports"] if p["name"] == "http"]
    http.update(hostPort=int(port), hostIP="127.0.0.1")
Path(out).write_text(yaml.safe_dump_all([*configmaps, pod], sort_keys=False))
print(pod["metadata"]["name"], f"{pod['metadata']['name']}-{launcher['name']}", pvc["metadata"]["name"],
      ",".join(c["metadata"]["name"] for c in configmaps), launcher["image"], min(ports, default=1024), str(loopback).lower())
PY
)

podman image exists "$launcher_image" ||
    die "no image $launcher_image in podman's store: bash images/launcher/build.sh launcher.tar && podman load -i launcher.tar"
! podman pod exists "$pod" || die "a pod $pod exists already: $(dirname "$0")/podman-down.sh stops and removes it"

# The claim first, as a cluster binds it before the pod starts, and only once: it outlives the pod, as a
# PVC does. A new one is empty; podman gives it to the pod's user (107) at its first mount, as fsGroup would.
if ! podman volume exists "$claim"; then
    podman kube play --quiet "$here/pvc.yaml" >/dev/null
    made_claim=true
fi

# The pod network: slirp4netns, a user-mode stack that adds no bridge or firewall rule to the host. Not
# on its default 10.0.2.0/24, which is also masquerade's vmNetworkCIDR inside the VM: with both the same,
# a connection from the pod's gateway (10.0.2.2) would reach the guest from its own address.
network=slirp4netns:port_handler=slirp4netns,cidr=10.0.3.0/24
if [ "$loopback" = true ]; then
    network+=,allow_host_loopback=true
    echo "$me: note: the registry is on this host's loopback, 10.0.3.2 from the pod: the pod, and its guest, can reach every service on this host's loopback" >&2
fi
state=created
podman kube play --quiet --start=false --network "$network" "$work/pod.yaml" >/dev/null

# qemu listens on the guest's declared ports as 107 with no capability, which the pod's sysctl allows;
# podman before 4.6 ignores a pod's sysctls, so check what the pod's network namespace has before the VM starts.
infra=$(podman pod inspect --format '{{.InfraContainerID}}' "$pod")
podman start "$infra" >/dev/null
start=$(nsenter --target "$(podman inspect --format '{{.State.Pid}}' "$infra")" --net cat /proc/sys/net/ipv4/ip_unprivileged_port_start)
if [ "$start" -gt "$lowest" ]; then
    die "the pod's net.ipv4.ip_unprivileged_port_start is $start, so qemu (107, no capability) cannot take port $lowest: podman before 4.6 ignores a pod's sysctls; add \"net.ipv4.ip_unprivileged_port_start=0\" to default_sysctls in the [containers] table of containers.conf"
fi
podman pod start "$pod" >/dev/null
state=started
echo "$me: pod $pod started: podman logs -f $container is the guest's console${port:+; its port 80 is http://127.0.0.1:$port/}; $(dirname "$0")/podman-down.sh stops it" >&2
