#!/usr/bin/env bash
# The whole suite (`make test`, which CI runs) as two pytest processes at once:
#
# - the stack tests (and the `serial` ones) in one process, with their output live. They spend much of
#   their time waiting on service processes that start, serve and stop, and keep about one of two cores busy;
# - every other test, in a second process beside them, with its output kept in a log that is printed
#   when both are done. It runs at a lower priority (nice 10), so that it takes the core the stack tests
#   leave idle and yields when they need both: they are the longer part, and their waits have deadlines.
#
# Each process draws ports from its own half of the range (LOCKSTEP_PORT_SLICE, services/common/process/ports.py).
# The exit status is non-zero when either process fails. docs/testing.md has the measurements.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE_MARKS="not gpu and not docker"

unit_log=$(mktemp -t lockstep-unit-tests.XXXXXX)
LOCKSTEP_PORT_SLICE=1/2 nice -n 10 "$PY" -m pytest -m "$BASE_MARKS and not stack and not serial" --durations=15 tests \
    >"$unit_log" 2>&1 &
unit_pid=$!
trap 'kill "$unit_pid" 2>/dev/null' INT TERM

LOCKSTEP_PORT_SLICE=0/2 "$PY" -m pytest -m "$BASE_MARKS and (stack or serial)" --durations=25 tests
stack_status=$?

wait "$unit_pid"
unit_status=$?
echo
echo "================ unit tests (ran beside the stack tests; exit status $unit_status) ================"
cat "$unit_log"
rm -f "$unit_log"
echo "stack tests: exit status $stack_status; unit tests: exit status $unit_status"
[ "$stack_status" -eq 0 ] && [ "$unit_status" -eq 0 ]
