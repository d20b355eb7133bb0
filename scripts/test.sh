#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite against the real tools.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DISKKIT_TESTGUEST_DIR="$PWD/build/testguest" DISKKIT_CLOUDGUEST_DIR="$PWD/build/cloudguest"
exec .venv/bin/python -m pytest "$@"
