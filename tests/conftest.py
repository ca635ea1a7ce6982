"""Shared test policy.

Tests that need an external binary or optional package call `require(...)`:
on a user's machine a missing part skips with the stated reason; in CI
(`LOCKSTEP_REQUIRE_ALL=1`) the same absence fails the test, so nothing CI is
meant to exercise can quietly turn into a skip.

Tests that start a stack (a service process, Redis, SGLang, Prometheus or Ray) carry the `stack`
marker. It is given here, from where a test lives and which fixtures it uses (STACK_DIRS,
STACK_FIXTURES, STACK_TESTS), and checked while the tests run: a test without it that starts one of
those processes fails, naming what it started. Unit tests that cost more than a few CPU-seconds are
marked `slow` here (SLOW_TESTS). `make test-quick` deselects both. `make test` runs everything in three
processes at once (tests/run_suite.sh): the `stack` tests and those marked `serial` here (SERIAL_TESTS);
the learning runs (`learning`, LEARNING_TESTS) and the sandbox tests (`sandbox`, SANDBOX_TESTS); the rest.
"""
from __future__ import annotations

import inspect
import os
import re
import sys
import threading
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# OpenMP threads (torch's intra-op pool, in this process and in every child it starts) that wait for work sleep at
# once instead of spinning. The suite runs several processes on two shared cores, so a thread of a team often
# waits for one that is descheduled; by default libgomp spins meanwhile, and a waiting thread burns a core doing
# nothing: a 2-thread reward-model build took 176 CPU-seconds spinning against 19 passive, with the same bits
# (the policy changes how threads wait, not how work is split). It must be set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The sandbox tests fork this process to run bubblewrap as nobody; with gRPC's fork support on, a child may
# restart gRPC's poller threads and fail (services/coordinator/__main__.py says how often). Before gRPC loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Without a GPU the Triton kernels run in Triton's interpreter, which Triton decides when it is first
# imported (its own library functions are decorated then). Modules the tests import may import Triton
# early (torch._dynamo does, and kernels.attention.hf imports that), so it is decided here, first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` and `make test-quick` run the unit tests in pytest-xdist workers: each draws its ports from its own
# part of the range (services.common.process.ports), so two workers never hand out the same one. Worker gwK takes
# the K-th slice of LOCKSTEP_WORKER_PORT_SLICES where that is set (tests/run_suite.sh: the other processes of
# `make test` hold the other slices), else slice K of as many as there are workers.
WORKER_SLICES_ENV = "LOCKSTEP_WORKER_PORT_SLICES"
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _index, _count = int(_XDIST_WORKER[2:]), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    if _slices := [s for s in os.environ.get(WORKER_SLICES_ENV, "").split(",") if s]:
        if len(_slices) != _count:
            raise RuntimeError(f"{WORKER_SLICES_ENV}={os.environ[WORKER_SLICES_ENV]!r} names {len(_slices)} port "
                               f"slices for {_count} pytest-xdist workers")
        os.environ["LOCKSTEP_PORT_SLICE"] = _slices[_index]
    else:
        os.environ.setdefault("LOCKSTEP_PORT_SLICE", f"{_index}/{_count}")


def require_all() -> bool:
    return os.environ.get("LOCKSTEP_REQUIRE_ALL", "") == "1"


def require(available: bool, reason: str) -> None:
    """Skip (user machine) or fail (CI) when `available` is false."""
    if available:
        return
    if require_all():
        pytest.fail(f"LOCKSTEP_REQUIRE_ALL=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_sglang_python() -> str:
    """The SGLang virtualenv's interpreter (`make sglang-venv`), through `require` when it is not built."""
    from services.rollout.sglang.config import default_python

    python = default_python()
    require(Path(python).is_file(), f"SGLang virtualenv not built ({python} missing): run `make sglang-venv`")
    return python


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(autouse=True)
def _restore_the_attention_policy():
    """A Trainer sets the process-wide attention policy (its service process runs one run at a time); a test
    that builds one in this process must not hand that policy to the tests after it, whatever their order."""
    registry = sys.modules.get("kernels.attention.registry")
    saved = registry.REGISTRY.policy if registry is not None else None
    yield
    registry = sys.modules.get("kernels.attention.registry")
    if registry is not None and registry.REGISTRY.policy != (saved or registry.AttentionPolicy()):
        registry.REGISTRY.set_policy(saved or registry.AttentionPolicy())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under LOCKSTEP_REQUIRE_ALL=1 no test may skip, whatever skipped it (importorskip included); a test
    the stack guard refused fails (see _StackGuard)."""
    outcome = yield
    report = outcome.get_result()
    if require_all() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"LOCKSTEP_REQUIRE_ALL=1 forbids skips: {report.longrepr}"
    if _GUARD.started:  # the refusal was raised where the test may not see it (a thread): fail it here too
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = _GUARD.refusal(item, ", ".join(_GUARD.started))
        _GUARD.started = []


# ---------------------------------------------------------------- the `stack` and `slow` markers

# Every test under these directories runs against real processes on loopback.
STACK_DIRS = ("tests/integration/",)

# Fixtures that start a stack, as (the file defining them, name): every test whose fixture closure holds
# one is a stack test, wherever the fixture is imported to.
STACK_FIXTURES = {
    ("tests/coordinator/conftest.py", "lone_coordinator"): "a coordinator process (and its redis-server)",
    ("tests/coordinator/state/test_event_log.py", "server"): "an embedded redis-server",
    ("tests/coordinator/state/test_store.py", "server"): "an embedded redis-server",
    ("tests/deploy/test_live_prometheus.py", "stack"): "the local stack",
    ("tests/deploy/test_live_prometheus.py", "prometheus"): "a Prometheus server",
    ("tests/recipes/test_recipe_train_rest.py", "coordinator"): "a coordinator process",
    ("tests/rollout/test_rollout_server_process.py", "server"): "a rollout service process",
    ("tests/rollout/sglang/test_sglang_engine.py", "engine"): "an SGLang server",
    ("tests/rollout/conftest.py", "sglang_request_types"): "the SGLang virtualenv's Python",
    ("tests/rollout/sglang/test_sglang_run.py", "stack"): "the local stack with SGLang",
    ("tests/trainer/weights/test_broadcast_abort.py", "trainer"): "a trainer service process",
    ("tests/trainer/test_trainer_server.py", "server"): "a trainer service process",
    ("tests/trainer/test_trainer_server.py", "parity_server"): "a trainer service process",
}

# Tests (path::name) or whole modules (path) that start one in their own body, or need the SGLang
# virtualenv (`make sglang-venv`, which `make test-quick` does not build).
STACK_TESTS = {
    "tests/coordinator/run/test_scheduler.py": "runs the scheduler against a redis-server",
    "tests/coordinator/state/test_store.py::test_appendonly_survives_server_restart": "restarts a redis-server",
    "tests/deploy/test_metric_names.py::test_sglang_names_exist_in_sglang": "reads the SGLang virtualenv",
    "tests/coordinator/run/test_fixed_lag.py::test_a_replica_reporting_another_version_is_refused_naming_the_step":
        "drives the fleet against a redis-server",
    "tests/rollout/weights/test_tcpstore_bridge.py::test_a_tcpstore_client_is_served_every_operation_and_forms_a_gloo_group":
        "runs a TCPStore client in the SGLang virtualenv's Python",
    "tests/rollout/sglang/test_sglang_command_line.py::test_sglangs_argparse_reads_each_command_line_as_the_config_says":
        "runs SGLang's argument parser in its virtualenv's Python",
}

# Tests that start no stack but cost more than a few CPU-seconds each (process groups, compilers, long
# computations): `make test-quick` leaves these out too, to stay an inner loop. Entries as in STACK_TESTS.
SLOW_TESTS = {
    "tests/coordinator/tasks/test_code_task.py::test_every_canonical_solution_passes_and_a_wrong_one_fails":
        "164 HumanEval executions in the sandbox",
    "tests/common/sandbox/test_hostile_programs.py": "fork and memory bombs, loops and sleeps to their limits",
    "tests/kernels/test_logprob_check_targets.py": "compiles every kernel for MI300 and Hopper",
    "tests/kernels/logprob/test_logprob_distributed.py": "a gloo group of forked processes",
    "tests/kernels/logprob/test_logprob_linear_distributed.py": "gloo groups of forked processes",
    "tests/kernels/moe/test_expert_parallel.py::test_expert_parallel_group_matches_one_process": "gloo groups",
    "tests/kernels/test_logprob_native_source.py": "compiles the native kernel with g++",
    "tests/trainer/distributed/test_data_parallel.py": "trainer ranks as processes",
    "tests/trainer/distributed/test_lora_data_parallel.py": "trainer ranks as processes",
    "tests/trainer/test_true_on_policy.py::test_a_data_parallel_group_scores_the_samplers_bits":
        "trainer ranks as processes",
    "tests/trainer/loss/test_policy_loss_trainer.py::test_m2po_mask_spans_every_rank_of_a_group":
        "trainer ranks as processes",
    "tests/trainer/test_mixed_precision.py::test_compiled_layers_train_like_eager_and_rerun_bitwise":
        "torch.compile",
    "tests/recipes/test_tiny_arith.py::test_warm_start_is_deterministic_and_writes_a_loadable_dir":
        "two warm starts as processes",
    "tests/recipes/test_tiny_tools.py::test_warm_start_is_deterministic_per_seed": "two warm starts as processes",
    "tests/deploy/test_prometheus_rules.py::test_unit_tests_catch_a_loosened_rule": "promtool per rule",
    "tests/coordinator/run/test_streaming.py::test_a_streamed_rollout_is_paused_by_a_sync_and_continued_under_the_new_weights":
        "a torch engine decode and two trainers scoring it",
    "tests/trainer/test_parity_gate.py::test_reference_attention_passes_the_gate": "rounding bounds of a model",
    "tests/kernels/logprob/test_logprob_linear.py::test_matches_unfused_path_and_fp64": "large float64 references",
    "tests/kernels/logprob/test_logprob_linear.py::test_weight_gradient_accumulates_in_fp32_across_chunks":
        "large float64 references",
    "tests/kernels/logprob/test_logprob_linear.py::test_a_token_does_not_depend_on_the_rest_of_the_call":
        "many calls of the fused head",
    "tests/common/weights/test_weight_stream_buffers.py::"
    "test_the_finite_check_finds_a_bad_value_wherever_chunks_cut_the_tensor": "one stream per cut",
}

# Tests that must run in `make test`'s stack process, never in a parallel worker. Entries as in STACK_TESTS.
SERIAL_TESTS = {
    "tests/kernels/test_logprob_check_targets.py":
        "tests/kernels/conftest.py starts its compile in the background as soon as it is collected: once, not "
        "once per worker",
}

# The learning bars, the other long training runs on the demo's warm start, and the Ray cluster's trainer ranks:
# `make test` runs them in a process of their own beside the stack process (tests/run_suite.sh). Each keeps
# about one core busy for a minute or more (the rollout and the trainer take turns), while the rest of the stack
# tests mostly wait on processes that start and stop; run one after the other they left the second core idle for
# most of the suite. The session's `warm_model` is built in that process only: every test that uses it is listed.
# Entries as in STACK_TESTS.
LEARNING_TESTS = {
    "tests/integration/runs/test_tiny_distill_run.py": "trains a teacher, then distils for 240 steps",
    "tests/integration/runs/test_tiny_code_learning.py": "a warm start, then GRPO steps of 128 sandboxed programs",
    "tests/integration/runs/test_lora_run.py": "100 LoRA GRPO steps on the warm start",
    "tests/integration/runs/test_sft_recipe_run.py": "the warm start's steps again, as an SFT run",
    "tests/integration/runs/test_dynamic_sampling_run.py": "uses the warm start",
    "tests/integration/runs/test_eval_stack.py": "uses the warm start",
    "tests/integration/runs/test_loss_options_run.py": "uses the warm start",
    "tests/integration/tracking/test_prompt_dataset_runs.py": "uses the warm start",
    "tests/integration/tracking/test_tracking_stack.py": "uses the warm start",
    "tests/integration/runs/test_ray_stack.py": "FSDP ranks trained through a two-node Ray cluster of its own",
    "tests/integration/rewards/test_tiny_judge_learning.py": "a reward model trained on the warm start, then GRPO",
    "tests/integration/rewards/test_reward_runs.py": "uses the warm start (on the reward stack)",
    "tests/integration/rewards/test_hostile_scorers.py": "uses the warm start (on the reward stack)",
}

# Tests that run programs in the bubblewrap sandbox. Every sandbox runs as one unprivileged uid, whose process
# count (RLIMIT_NPROC) all concurrent sandboxes share, so `make test` runs them all in one process, the
# learning process (with tests/integration/runs/test_tiny_code_learning.py's pool), one after the other.
# Entries as in STACK_TESTS.
SANDBOX_TESTS = {
    "tests/common/sandbox/test_hostile_programs.py": "fork and memory bombs in the sandbox",
    "tests/common/sandbox/test_sandbox_refuses.py": "starts sandboxes",
    "tests/coordinator/tasks/test_code_task.py": "runs the code task's programs",
    "tests/recipes/test_tiny_code.py": "runs the code demo's programs",
    "tests/integration/runs/test_tiny_code_learning.py": "a pool of sandboxes per step",
}

BACKGROUND_BUILD_FIXTURE = "reward_model_build"
"""tests/integration/conftest.py's fixture that builds the reward model in the background."""

# `python -m <module>` of these is a service process.
SERVICE_MODULES = ("services.coordinator", "services.rollout", "services.trainer", "services.ray_stack")


def _relative(path: str | os.PathLike) -> str:
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _listed(item: pytest.Item, table: dict[str, str]) -> str | None:
    where = item.nodeid.split("[", 1)[0]
    for key in (where, where.split("::", 1)[0]):
        if key in table:
            return table[key]
    return None


def _stack_reason(item: pytest.Item) -> str | None:
    """Why `item` is a stack test, or None."""
    if item.nodeid.startswith(STACK_DIRS):
        return "lives in " + next(d for d in STACK_DIRS if item.nodeid.startswith(d))
    if (reason := _listed(item, STACK_TESTS)) is not None:
        return reason
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in (info.name2fixturedefs.get(name, ()) if info else ()):
            key = (_relative(inspect.getsourcefile(fixturedef.func) or ""), fixturedef.argname)
            if key in STACK_FIXTURES:
                return f"fixture {key[1]} ({key[0]}) starts {STACK_FIXTURES[key]}"
    return None


def _stale_entries() -> list[str]:
    """Entries of the tables above that name no file, test or fixture (renamed or removed since)."""
    entries = [(k.partition("::")[0], k.partition("::")[2])
               for k in (*STACK_TESTS, *SLOW_TESTS, *SERIAL_TESTS, *LEARNING_TESTS, *SANDBOX_TESTS)]
    stale = []
    for path, name in [*entries, *STACK_FIXTURES]:
        source = REPO_ROOT / path
        if not source.is_file() or (name and not re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M)):
            stale.append(f"{path}::{name}" if name else path)
    return stale


def pytest_configure(config):
    if stale := _stale_entries():
        raise pytest.UsageError(f"tests/conftest.py's marker tables name what does not exist: {stale}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _stack_reason(item) is not None:
            item.add_marker(pytest.mark.stack)
        if _listed(item, SLOW_TESTS) is not None:
            item.add_marker(pytest.mark.slow)
        if _listed(item, SERIAL_TESTS) is not None:
            item.add_marker(pytest.mark.serial)
        if _listed(item, LEARNING_TESTS) is not None:
            item.add_marker(pytest.mark.learning)
        if _listed(item, SANDBOX_TESTS) is not None:
            item.add_marker(pytest.mark.sandbox)
    # Last, in their order: the tests that wait for the reward model's background build
    # (tests/integration/conftest.py), so that the learning runs before them overlap with it.
    waiting = [item for item in items if BACKGROUND_BUILD_FIXTURE in item.fixturenames]
    if waiting:
        items[:] = [item for item in items if BACKGROUND_BUILD_FIXTURE not in item.fixturenames] + waiting


def stack_process(argv) -> str | None:
    """What a command line starts, if it is part of a stack: a service, Redis, SGLang, Prometheus or Ray."""
    args = [os.fspath(a) for a in ([argv] if isinstance(argv, (str, bytes, os.PathLike)) else argv)]
    args = [a.decode() if isinstance(a, bytes) else a for a in args]
    from services.common.process.parent_death import wrapped_command
    args = wrapped_command(args)  # a command started to die with its parent: what it runs
    if not args:
        return None
    program = Path(args[0]).name
    if program.startswith("redis-server"):
        return "a redis-server"
    if program == "prometheus":
        return "a Prometheus server"
    if program in ("raylet", "gcs_server") or "/ray/" in args[0] or program == "ray":
        return "Ray"
    from services.rollout.config import default_sglang_python
    if ".venv-sglang" in args[0] or args[0] == default_sglang_python():
        return "SGLang (its virtualenv's Python)"
    if "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module in SERVICE_MODULES:
            return f"the {module} service"
        if module.split(".")[0] in ("sglang", "ray"):
            return module
    return None


# Threads that start a session's shared stack in the background (tests/rollout/conftest.py's SessionSGLang,
# started when collection ends): what they start belongs to the session, not to whichever test runs meanwhile.
SESSION_START_THREADS = frozenset({"session-sglang-start"})


class _StackGuard:
    """Fails a test that is not marked `stack` yet starts a stack process (seen through the audit hook
    subprocess.Popen raises), so the marker cannot fall behind the tests."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []

    def audit(self, event: str, args: tuple) -> None:
        if event != "subprocess.Popen" or self.item is None or self.item.get_closest_marker("stack"):
            return
        if threading.current_thread().name in SESSION_START_THREADS:
            return
        what = stack_process(args[1] if args[1] is not None else args[0])
        if what is not None:
            self.started.append(what)
            raise RuntimeError(self.refusal(self.item, what))

    @staticmethod
    def refusal(item: pytest.Item, what: str) -> str:
        return (f"{item.nodeid} starts {what} but is not marked `stack`: mark it (@pytest.mark.stack), or add it "
                "or the fixture that starts it to STACK_TESTS / STACK_FIXTURES in tests/conftest.py")


_GUARD = _StackGuard()
sys.addaudithook(_GUARD.audit)  # audit hooks cannot be removed; outside a test's run it does nothing


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _GUARD.item, _GUARD.started = item, []
    try:
        yield
    finally:
        _GUARD.item = None
