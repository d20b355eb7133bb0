#!/usr/bin/env bash
# A medius-style containerDisk pipeline (kubevirt/containerdisks' medius: detect, build, verify,
# promote), for one disk an upstream publishes with a checksum file:
#
#   detect    the upstream's version: $UPSTREAM/$VERSION_FILE's first line (or $VERSION as given)
#   download  $UPSTREAM/$ARTIFACT ({VERSION} replaced), checked against $UPSTREAM/$CHECKSUM_FILE
#   build     into the candidates repository $STAGING:VERSION, labelled $LABEL_KEY=sha256:SUM; an
#             upstream whose checksum the last candidate already carries is skipped (exit 0)
#   verify    the pushed digest, as KubeVirt consumes it
#   boot-test the pushed digest with `launcher test` (ssh, --fail-on a panic)
#   promote   the tested digest to $REGISTRY/$NAME as VERSION-YYMMDDhhmm, VERSION and latest
#   prune     dated tags of $REGISTRY/$NAME matching $PRUNE_MATCH, keeping the newest $KEEP; a
#             digest VERSION or latest points at is never deleted
#
# A candidate that fails verify or the boot test is deleted (so the next run tries again) and
# nothing is promoted; the script exits with the failing command's status (docs/cli.md's table).
#
# Configuration (environment):
#   REGISTRY       registry host[:port] (required)            NAME      image name (required)
#   UPSTREAM       base URL of the upstream (required)        ARTIFACT  file name, {VERSION} in it (required)
#   VERSION_FILE   version file under UPSTREAM [VERSION]      VERSION   skip detection, use this version
#   CHECKSUM_FILE  checksum file under UPSTREAM [SHA256SUMS]  (GNU `HEX  name` or BSD `SHA256 (name) = HEX`)
#   STAGING        candidates repository [$REGISTRY/$NAME-candidates]
#   LABEL_KEY      label carrying the upstream checksum [shasum]
#   KEEP           dated tags kept [3]                        PRUNE_MATCH  [.+-[0-9]{10}]
#   TEST_USER      ssh user of the boot test [the image's label, else cloud-init's default user, else root]
#   TEST_TIMEOUT   seconds [600]
#   TEST_ARGS      more `launcher test` options, word-split (e.g. "--memory 2Gi --expect 'login:'")
#   BUILD_TIME     seconds since the epoch of this build [now]: the dated tag and the image's created time
#   TLS_VERIFY     false for a plain-HTTP registry [true]
#   WORKDIR        where build.json, verify.json and test.json are kept [./pipeline-out]
#
# Example:
#   REGISTRY=localhost:5000 NAME=disks/fedora UPSTREAM=https://dl.example.org/fedora/40 \
#   ARTIFACT='Fedora-Cloud-{VERSION}.x86_64.qcow2' CHECKSUM_FILE=CHECKSUM \
#   TEST_ARGS="--memory 2Gi" examples/ci/pipeline.sh
set -euo pipefail

: "${REGISTRY:?set REGISTRY (host[:port])}" "${NAME:?set NAME (the image name)}"
: "${UPSTREAM:?set UPSTREAM (base URL)}" "${ARTIFACT:?set ARTIFACT (file name, {VERSION} in it)}"
UPSTREAM=${UPSTREAM%/}
STAGING=${STAGING:-$REGISTRY/$NAME-candidates}
LIVE=$REGISTRY/$NAME
LABEL_KEY=${LABEL_KEY:-shasum}
KEEP=${KEEP:-3}
PRUNE_MATCH=${PRUNE_MATCH:-'.+-[0-9]{10}'}
BUILD_TIME=${BUILD_TIME:-$(date +%s)}
WORKDIR=${WORKDIR:-pipeline-out}
tls=()
[[ ${TLS_VERIFY:-true} == false ]] && tls=(--tls-verify=false)
mkdir -p "$WORKDIR"

step() { printf '== %s\n' "$*" >&2; }
die() { printf 'pipeline: %s\n' "$*" >&2; exit "${2:-1}"; }

# --- detect
if [[ -z ${VERSION:-} ]]; then
    VERSION=$(curl -fsSL "$UPSTREAM/${VERSION_FILE:-VERSION}" | head -n 1 | tr -d '[:space:]') ||
        die "$UPSTREAM/${VERSION_FILE:-VERSION}: cannot be read"
fi
[[ $VERSION =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$ ]] || die "version '$VERSION': not usable in a tag ([A-Za-z0-9_][A-Za-z0-9_.-]*)"
artifact=${ARTIFACT//\{VERSION\}/$VERSION}
sums_url=$UPSTREAM/${CHECKSUM_FILE:-SHA256SUMS}
step "upstream $VERSION: $UPSTREAM/$artifact"

# The upstream's own checksum of the artifact is the rebuild key (medius labels images with it).
sum=$(curl -fsSL "$sums_url" | awk -v name="$artifact" '
    length($1) == 64 && $1 ~ /^[0-9a-fA-F]+$/ && ($2 == name || $2 == "*" name) { print tolower($1); exit }
    $1 == "SHA256" && $2 == "(" name ")" && $3 == "=" { print tolower($4); exit }') ||
    die "$sums_url: cannot be read"
[[ -n $sum ]] || die "$sums_url: no SHA256 entry for $artifact"

# --- download, check, build (or skip)
stamp=$(date -u -d "@$BUILD_TIME" +%y%m%d%H%M)
step "build $STAGING:$VERSION ($LABEL_KEY=sha256:$sum)"
SOURCE_DATE_EPOCH=$BUILD_TIME diskkit build "${tls[@]}" "$UPSTREAM/$artifact" --checksum-file "$sums_url" \
    -t "$STAGING:$VERSION" --label "$LABEL_KEY=sha256:$sum" --skip-if-label "$LABEL_KEY=sha256:$sum" \
    --annotation "org.opencontainers.image.version=$VERSION" --annotation "org.opencontainers.image.source=$UPSTREAM/$artifact" \
    --json >"$WORKDIR/build.json"
field() { python3 -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1], ""))' "$1"; }
if [[ $(field skipped <"$WORKDIR/build.json") == True ]]; then
    digest=$(diskkit inspect "${tls[@]}" --json "$STAGING:$VERSION" | field digest)
    live=$(diskkit inspect "${tls[@]}" --json "$LIVE:$VERSION" 2>/dev/null | field digest) || live=
    if [[ $digest == "$live" ]]; then
        step "upstream unchanged: $LIVE:$VERSION already carries $LABEL_KEY=sha256:$sum; nothing done"
        exit 0
    fi
    # A run stopped between its build and its promotion: that candidate is tested now, not rebuilt.
    step "upstream unchanged, but its candidate $STAGING@$digest was never promoted: testing it"
else
    digest=$(field digest <"$WORKDIR/build.json")
fi
[[ -n $digest ]] || die "$WORKDIR/build.json: no digest"
candidate=$STAGING@$digest

# A candidate that fails is deleted: not promoted, and rebuilt by the next run.
reject() {
    local status=$1 why=$2
    diskkit delete "${tls[@]}" --ignore-missing "$STAGING:$VERSION" >&2 || true
    die "$candidate: $why; not promoted, candidate deleted" "$status"
}

# --- verify
step "verify $candidate"
status=0
diskkit verify "${tls[@]}" --json "$candidate" >"$WORKDIR/verify.json" || status=$?
((status == 0)) || reject "$status" "verify failed (exit $status, $WORKDIR/verify.json)"

# --- boot test
step "boot-test $candidate"
eval "extra=(${TEST_ARGS:-})"  # the CI owner's own words, quotes kept
status=0
launcher test "${tls[@]}" --json --timeout "${TEST_TIMEOUT:-600}" ${TEST_USER:+--user "$TEST_USER"} \
    --fail-on 'Kernel panic' --fail-on 'Call Trace' "${extra[@]}" "$candidate" >"$WORKDIR/test.json" || status=$?
((status == 0)) || reject "$status" "boot test failed (exit $status, $WORKDIR/test.json)"

# --- promote
tags="$VERSION-$stamp,$VERSION,latest"
step "promote $candidate to $LIVE: $tags"
diskkit promote "${tls[@]}" "$candidate" "$LIVE" --tags "$tags" >&2

# --- prune
step "prune $LIVE: tags matching $PRUNE_MATCH, keeping $KEEP"
diskkit prune "${tls[@]}" "$LIVE" --match "$PRUNE_MATCH" --keep "$KEEP" >&2
echo "$LIVE:$VERSION@$digest"
