#!/usr/bin/env bash
# The main job end to end: build the test guest disk, package it as a containerDisk image and
# push it to a registry started here, read it back, verify it the way KubeVirt will, then boot
# it with the launcher (libvirt session, as the unprivileged qemu user) and show its console.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
work=$PWD/build/demo
rm -rf "$work" && mkdir -p "$work/registry"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$work/registry/config.yml" <<YAML
version: 0.1
log: {level: error}
storage:
  filesystem: {rootdirectory: $work/registry/data}
  delete: {enabled: true}
http: {addr: 127.0.0.1:$port, secret: demo}
YAML
docker-registry serve "$work/registry/config.yml" >"$work/registry/log" 2>&1 &
registry_pid=$!
trap 'kill $registry_pid 2>/dev/null || true' EXIT
python3 - "$port" <<'PY'
import socket, sys, time
for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), 0.2).close()
        break
    except OSError:
        time.sleep(0.1)
PY

image=127.0.0.1:$port/disks/testguest:v1
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

step diskkit build build/testguest/testguest.qcow2 -t "$image" --tls-verify=false
step diskkit inspect --tls-verify=false "docker://$image"
step diskkit push --tls-verify=false "docker://$image" "oci:$work/pulled:testguest"
step diskkit verify "oci:$work/pulled:testguest"
step skopeo inspect --tls-verify=false --format '{{.Digest}} {{.Os}}/{{.Architecture}} layers={{len .Layers}}' "docker://$image"

# Boot it: the VMI from examples/, pointed at this registry. As root the VM runs as the qemu
# user (UID 107) through its own libvirt session daemon, as KubeVirt's non-root launcher does.
sed "s|registry.example.com/disks/testguest:v1|$image|" examples/vmi-containerdisk.yaml >"$work/vmi.yaml"
as_user=()
if [ "$(id -u)" -eq 0 ]; then
    mkdir -p "$work/qemu-home" && chown 107 "$work/qemu-home" && chmod 755 "$work"
    as_user=(setpriv --reuid=107 --regid=107 --clear-groups env "HOME=$work/qemu-home" XDG_RUNTIME_DIR= "DISKKIT_CACHE=$work/qemu-home/cache")
fi
step "${as_user[@]}" launcher run --tls-verify=false --console --timeout 300 "$work/vmi.yaml"
