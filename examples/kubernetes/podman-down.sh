#!/usr/bin/env bash
# Stop the pod podman-play.sh played, as the kubelet stops one, then remove it:
#
#   podman-down.sh
#
# SIGTERM makes the launcher press the guest's ACPI power button and wait for it to power off (up to
# the VMI's grace period), and podman waits pod.yaml's terminationGracePeriodSeconds before it kills.
# podman 4.3's `kube down` alone kills at once (podman #22397, fixed in 5.1): a guest killed so loses
# what it had not written, and the VM's overlay is left in the cache. What the pod said while it
# stopped (the guest's last console lines, the launcher's) is printed. The claim's volume stays, as a
# PVC outlives its pod (podman volume rm testguest-data drops it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ $# = 0 ] || { echo "usage: $0" >&2; exit 2; }
read -r pod container grace < <(python3 - "$here/pod.yaml" <<'PY'
import sys
import yaml
(pod,) = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
(launcher,) = [c for c in pod["spec"]["containers"] if c["name"] == "launcher"]
print(pod["metadata"]["name"], f"{pod['metadata']['name']}-{launcher['name']}", pod["spec"]["terminationGracePeriodSeconds"])
PY
)
# Without systemd, podman says "unable to get systemd connection to remove healthchecks" about the
# liveness probe's timer it could not have made: nothing went wrong, so that line is left out.
podman_quiet() {
    local err status=0
    err=$(podman "$@" 2>&1 >/dev/null) || status=$?
    [ -z "$err" ] || grep -v 'unable to get systemd connection to remove healthchecks' <<<"$err" >&2 || true
    return $status
}
since=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
podman_quiet pod stop --time "$grace" "$pod"
podman logs --since "$since" "$container"
podman_quiet kube down "$here/pod.yaml"
