#!/usr/bin/env bash
# The main job end to end: build the test guest disk, package it as a containerDisk image and
# push it to a registry started here, read it back, verify it the way KubeVirt will, then boot
# it with the launcher (libvirt session, as the unprivileged qemu user), show its console and stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo   # the demo's packages only, not the test suite's toolchain
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

# Boot it: the VMI from examples/, pointed at this registry. As root with no libvirt system daemon
# (the demo installs none) the launcher runs the VM as the qemu user (UID 107) through that user's
# own libvirt session daemon, as KubeVirt's non-root launcher does; it says so in one line.
# The test guest reports its disks on the console and then waits, as a real guest does, until its
# power button is pressed: `launcher stop` presses it.
sed "s|registry.example.com/disks/testguest:v1|$image|" examples/vmi-containerdisk.yaml >"$work/vmi.yaml"
step launcher run --tls-verify=false --detach --wait-for 'DISKKIT-TESTGUEST DONE' --timeout 300 "$work/vmi.yaml"
step launcher logs testguest
step launcher ls
step launcher stop testguest
