#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite against the real tools.
#   ./scripts/test.sh                 everything, three tests at a time (the suite's budget: 20 minutes of tests on 2 cores)
#   ./scripts/test.sh --quick         the quick tier: no test that boots a guest, nor any marked slow
#   ./scripts/test.sh -m 'not vm'     every test that boots no guest
#   ./scripts/test.sh tests/test_x.py pytest's own arguments pass through
# DISKKIT_TEST_WORKERS sets how many tests run at once (default 3; 2 runs without the background lane; 0 in this process).
# Every run ends with the slowest tests, the seconds per file and the total against the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The real cloud guest is built by the first test that boots it, once per machine (tests/cloudguest.py).
export DISKKIT_TESTGUEST_DIR="$PWD/build/testguest"
# Thousands of launcher and diskkit processes start during a run: each compiles every module it
# imports unless bytecode is kept, twice the start-up CPU. Compiled once here (the qemu user's
# processes cannot write __pycache__), kept for the run.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m compileall -q -j 0 diskkit launcher tests >/dev/null
# Guests boot under TCG and take both cores: two lanes take the tests that boot guests, a third (the
# background lane, tests/lanes.py, at nice 10) the rest, in the time the guest lanes wait. The quick
# tier boots none: its three workers are all at one priority.
DEFAULT_WORKERS=3
WORKERS=${DISKKIT_TEST_WORKERS:-$DEFAULT_WORKERS}
PARALLEL=()
if [ "$WORKERS" != 0 ]; then
    # A file's tests stay on one worker: its module fixtures (a registry, a session daemon, a booted
    # guest shared by its checks) are made once.
    PARALLEL=(-n "$WORKERS" --dist loadfile)
fi
# Under a subreaper: libvirt calls a stopped VM shut off only once its qemu, an orphan, is reaped.
exec .venv/bin/python scripts/subreaper.py .venv/bin/python -m pytest "${PARALLEL[@]}" --durations=30 "$@"
