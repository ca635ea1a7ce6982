#!/usr/bin/env bash
# The whole suite (`make test`, which CI runs) as three pytest processes at once:
#
# - the stack tests (and the `serial` ones) in one process, with their output live. They spend much of
#   their time waiting on service processes that start, serve and stop, and keep about one of two cores busy;
# - the learning runs (`learning`: the learning bars and the other long runs on the warm start, on a stack of
#   their own) and the sandbox tests (`sandbox`: they must never run beside each other), at nice 5. A learning
#   run keeps about one core busy; beside the stack tests it takes the core they leave idle;
# - every other test (the unit tests), at nice 10, so that it takes what the two others leave idle and yields
#   when they need the cores: they are the longer parts, and their waits have deadlines. It runs in two
#   pytest-xdist workers, so that when the stack processes are done it can take both cores.
#
# The output of the two background processes is kept in logs that are printed when all three are done.
# Each process, and each xdist worker, draws ports from its own quarter of the range (LOCKSTEP_PORT_SLICE,
# services/common/process/ports.py; LOCKSTEP_WORKER_PORT_SLICES, tests/conftest.py).
# The exit status is non-zero when any process fails. docs/testing.md has the measurements.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE_MARKS="not gpu and not docker"
APART="learning or sandbox"

learning_log=$(mktemp -t lockstep-learning-tests.XXXXXX)
unit_log=$(mktemp -t lockstep-unit-tests.XXXXXX)
LOCKSTEP_PORT_SLICE=1/4 nice -n 5 "$PY" -m pytest -m "$BASE_MARKS and ($APART)" --durations=15 tests \
    >"$learning_log" 2>&1 &
learning_pid=$!
LOCKSTEP_WORKER_PORT_SLICES=2/4,3/4 nice -n 10 "$PY" -m pytest -n 2 \
    -m "$BASE_MARKS and not stack and not serial and not ($APART)" --durations=15 tests >"$unit_log" 2>&1 &
unit_pid=$!
trap 'kill "$learning_pid" "$unit_pid" 2>/dev/null' INT TERM

LOCKSTEP_PORT_SLICE=0/4 "$PY" -m pytest -m "$BASE_MARKS and (stack or serial) and not ($APART)" --durations=25 tests
stack_status=$?

wait "$learning_pid"
learning_status=$?
wait "$unit_pid"
unit_status=$?
echo
echo "================ learning and sandbox tests (ran beside the stack tests; exit status $learning_status) ================"
cat "$learning_log"
echo
echo "================ unit tests (ran beside the stack tests; exit status $unit_status) ================"
cat "$unit_log"
rm -f "$learning_log" "$unit_log"
echo "stack tests: exit status $stack_status; learning tests: exit status $learning_status; unit tests: exit status $unit_status"
[ "$stack_status" -eq 0 ] && [ "$learning_status" -eq 0 ] && [ "$unit_status" -eq 0 ]
