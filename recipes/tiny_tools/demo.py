"""`make demo-tools`: a tiny policy learns to call a calculator tool across turns, on a laptop CPU.

1. Build the tiny Qwen3 policy and its tokenizer in code and give it a short supervised warm start on
   scripted calculator episodes (recipes.tiny_tools.prepare), cached per seed and settings.
2. Start the real services on loopback: trainer, rollout, coordinator (which starts an embedded Redis).
3. Submit recipe.yaml (task `calculator`, 3-turn episodes, numerics true_on_policy) and show progress.
4. Play the held-out problems greedily with the final checkpoint, in this process, to count tool calls.
5. Write summary.json, metrics.json and a plot into the run directory; the last line printed is the
   path of summary.json.

summary.json: `initial_accuracy` / `final_accuracy` are the run's own held-out greedy evaluations
(before step 1, after the last step); `initial_tool_call_rate` / `final_tool_call_rate` and the
`correct_` ones (a call that computes the problem's product) come from the in-process greedy check of
the warm-started model and of the final checkpoint; `wall_s` is the whole demo, warm start included
when it was built by this invocation (`warm_start_cached` says), and `loadavg_before` / `loadavg_after`
are the host's 1/5/15-minute load averages, because on a shared machine they inflate every time here.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from recipes.tiny_arith.demo import write_outputs
from recipes.tiny_tools.check import check
from services.cli.client import load_recipe
from services.cli.progress import RunProgress
from services.local_stack import LocalStack

RECIPE = Path(__file__).with_name("recipe.yaml")


GAIN = 0.2
"""The held-out accuracy gain whose arrival time summary.json records."""


class GainClock:
    """Seconds from `t0` until a run's held-out eval first reads `gain` above its initial eval (None until
    then), as seen by polling the run (so late by at most one poll)."""

    def __init__(self, t0: float, gain: float) -> None:
        self.t0, self.gain, self.seconds = t0, gain, None

    def __call__(self, run: dict) -> None:
        initial = (run.get("eval_initial") or {}).get("accuracy")
        latest = (run.get("latest") or {}).get("metrics", {}).get("eval_accuracy")
        if self.seconds is None and initial is not None and latest is not None and latest >= initial + self.gain:
            self.seconds = round(time.monotonic() - self.t0, 2)


def warm_start_fingerprint(seed: int, warm) -> str:
    """Names the cached model dir: the seed and every setting that shapes the warm-started weights."""
    from recipes.tiny_tools import MODEL, TASK_OPTIONS

    text = repr((seed, MODEL, warm, json.dumps(TASK_OPTIONS, sort_keys=True)))
    return f"seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def prepare_model(out: Path, seed: int, warm, console: Console) -> tuple[dict, bool]:
    """(prepare's facts, whether they were cached): built once per fingerprint (deterministic, so the
    cache is exact)."""
    stamp = out / "prepare.json"
    if stamp.exists():
        return json.loads(stamp.read_text()), True
    console.print(f"building the tiny Qwen3 policy and its supervised warm start -> {out}")
    proc = subprocess.run([sys.executable, "-m", "recipes.tiny_tools.prepare", "--out", str(out), "--seed",
                           str(seed), "--steps", str(warm.steps), "--tool-fraction", str(warm.tool_fraction)],
                          check=True, capture_output=True, text=True)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    stamp.write_text(json.dumps(info))
    return info, False


def final_checkpoint(run_dir: Path, run_id: str) -> Path:
    """The last checkpoint the run wrote (the trainer always saves one after the last step)."""
    found = sorted((run_dir / "coordinator" / run_id / "checkpoints").glob("step_*"))
    if not found:
        raise FileNotFoundError(f"run {run_id}: no checkpoint under {run_dir / 'coordinator' / run_id}")
    return found[-1]


def summarize(run: dict, metrics: dict, prep: dict, final_check: dict | None) -> dict:
    steps = metrics["steps"]
    evals = [(s["step"], s["metrics"]["eval_accuracy"]) for s in steps if "eval_accuracy" in s["metrics"]]
    first, last = (steps[0]["metrics"], steps[-1]["metrics"]) if steps else ({}, {})
    final_check = final_check or {}
    return {
        "run_id": run["id"],
        "status": run["status"],
        "steps": len(steps),
        "initial_accuracy": (metrics.get("eval_initial") or {}).get("accuracy"),
        "final_accuracy": evals[-1][1] if evals else None,
        "initial_tool_call_rate": prep.get("heldout_tool_call_rate"),
        "final_tool_call_rate": final_check.get("heldout_tool_call_rate"),
        "initial_correct_tool_call_rate": prep.get("heldout_correct_tool_call_rate"),
        "final_correct_tool_call_rate": final_check.get("heldout_correct_tool_call_rate"),
        "initial_check_accuracy": prep.get("heldout_accuracy"),
        "final_check_accuracy": final_check.get("heldout_accuracy"),
        "train_tool_calls_mean_first_step": first.get("episode_tool_calls_mean"),
        "train_tool_calls_mean_last_step": last.get("episode_tool_calls_mean"),
        "train_reward_mean_first_step": first.get("reward_mean"),
        "train_reward_mean_last_step": last.get("reward_mean"),
        "step1_iw_min": first.get("iw_min"),
        "step1_iw_max": first.get("iw_max"),
        "step1_logprob_abs_diff_max": first.get("logprob_abs_diff_max"),
    }


def run_on(stack: LocalStack, spec: dict, *, prep: dict, cached: bool, console: Console, t0: float,
           load_before: tuple[float, float, float]) -> tuple[Path, dict]:
    """Submit `spec` to a running stack, wait, check the last checkpoint, write the run's files into
    stack.run_dir; returns (summary.json's path, the summary)."""
    client = stack.client()
    try:
        t_rl = time.monotonic()
        run = client.submit(spec)
        gain = GainClock(t0, GAIN)
        with RunProgress(console) as progress:
            run = client.wait(run["id"], poll_s=0.5, on_update=lambda r: (gain(r), progress(r)))
        rl_seconds = time.monotonic() - t_rl
        metrics = client.metrics(run["id"])
    finally:
        client.close()
    run_dir = stack.run_dir
    final_check = None
    if run["status"] == "completed":  # the same held-out problems as the run's own eval
        final_check = check(str(final_checkpoint(run_dir, run["id"])),
                            heldout_size=spec.get("eval", {}).get("heldout_size", 200))
    summary = summarize(run, metrics, prep, final_check)
    summary.update({
        "warm_start_cached": cached,
        "warm_start_s": round(prep["seconds"], 2),
        "rl_s": round(rl_seconds, 2),
        "wall_s": round(time.monotonic() - t0, 2),
        "wall_s_with_warm_start": round(time.monotonic() - t0 + (prep["seconds"] if cached else 0.0), 2),
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        f"s_to_accuracy_gain_{GAIN}": gain.seconds,
    })
    return write_outputs(run, metrics, summary, run_dir, console), summary


def main(argv: list[str] | None = None) -> int:
    from recipes.tiny_tools import WARM_START

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None,
                   help="Where logs, checkpoints and the summary go (default runs/demo-tools-<time>).")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--seed", type=int, default=None, help="Override the recipe's seed (also seeds the warm start).")
    p.add_argument("--steps", type=int, default=None, help="Override the recipe's step count.")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=JSON",
                   help="Override a recipe field (dotted key, JSON value), e.g. rollout.prompts_per_step=4.")
    p.add_argument("--warm-start-steps", type=int, default=None,
                   help=f"Override the warm start's steps ({WARM_START.steps}).")
    p.add_argument("--models-dir", default="runs/models", help="Where warm-started models are cached.")
    args = p.parse_args(argv)
    console = Console()
    t0, load_before = time.monotonic(), os.getloadavg()
    run_dir = Path(args.run_dir or f"runs/demo-tools-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = {k: v for k, v in (("seed", args.seed), ("steps", args.steps)) if v is not None}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set {item}: expected KEY=JSON")
        overrides[key] = json.loads(value)
    spec = load_recipe(args.recipe, overrides)
    warm = WARM_START if args.warm_start_steps is None else dataclasses.replace(WARM_START, steps=args.warm_start_steps)
    models = Path(args.models_dir).resolve()
    model_dir = models / f"tiny_tools-{warm_start_fingerprint(spec['seed'], warm)}"
    prep, cached = prepare_model(model_dir, spec["seed"], warm, console)
    console.print(f"warm start{' (cached)' if cached else ''}: held-out greedy accuracy {prep['heldout_accuracy']}, "
                  f"tool-call rate {prep['heldout_tool_call_rate']} ({prep['seconds']:.0f}s to build)")
    spec["model_path"] = str(model_dir)
    with LocalStack(run_dir, path_roots=[models]) as stack:
        console.print(f"services up: coordinator {stack.api_url}, logs in {run_dir / 'logs'}")
        path, summary = run_on(stack, spec, prep=prep, cached=cached, console=console, t0=t0, load_before=load_before)
    print(path)
    return 0 if summary["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
