"""The tiny code demo: a tiny policy learns, from execution alone, to write `a*b` rather than `12`.

    python -m recipes.tiny_code.demo [--seed S] [--run-dir DIR]

1. Build the problems and the warm-started tiny Qwen3 policy (recipes.tiny_code.prepare), cached per seed.
2. Start the real services on loopback: trainer, rollout, coordinator (embedded Redis); the coordinator
   runs every response in the bubblewrap sandbox (the `code` task) and refuses to start the run without it.
3. Submit recipe.yaml and show progress; the held-out greedy eval (64 problems never trained on) is itself
   scored by execution.
4. Write summary.json, metrics.json and a plot into the run directory; the last line printed is the path
   of summary.json.

summary.json: `initial_accuracy` / `final_accuracy` are the run's own held-out evals before step 1 and
after the last step; `s_to_accuracy_gain_0.2` counts seconds from the demo's start (warm start included
when this invocation built it) until an eval first read 0.2 above the initial one; `code_outcomes_*` are
the first and last steps' outcome counts; `loadavg_*` because a shared host inflates every time here.
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
from recipes.tiny_tools.demo import GainClock
from services.cli.client import load_recipe
from services.cli.progress import RunProgress
from services.local_stack import LocalStack

RECIPE = Path(__file__).with_name("recipe.yaml")
GAIN = 0.2
OUTCOMES = ("passed", "failed", "timeout", "crashed", "output_limit", "refused")


def warm_start_fingerprint(seed: int, warm) -> str:
    from recipes.tiny_code import MODEL, TASK_OPTIONS, problems

    text = repr((seed, MODEL, warm, json.dumps(TASK_OPTIONS, sort_keys=True), json.dumps(problems())))
    return f"seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def prepare_model(out: Path, seed: int, warm, console: Console) -> tuple[dict, bool]:
    """(prepare's facts, whether they were cached): built once per fingerprint (deterministic)."""
    stamp = out / "prepare.json"
    if stamp.exists():
        return json.loads(stamp.read_text()), True
    console.print(f"building the problems, the tiny Qwen3 policy and its warm start -> {out}")
    proc = subprocess.run([sys.executable, "-m", "recipes.tiny_code.prepare", "--out", str(out), "--seed", str(seed),
                           "--steps", str(warm.steps), "--expression-fraction", str(warm.expression_fraction)],
                          check=True, capture_output=True, text=True)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    stamp.write_text(json.dumps(info))
    return info, False


def summarize(run: dict, metrics: dict, prep: dict) -> dict:
    steps = metrics["steps"]
    evals = [s["metrics"]["eval_accuracy"] for s in steps if "eval_accuracy" in s["metrics"]]
    first, last = (steps[0]["metrics"], steps[-1]["metrics"]) if steps else ({}, {})
    return {
        "run_id": run["id"], "status": run["status"], "steps": len(steps),
        "initial_accuracy": (metrics.get("eval_initial") or {}).get("accuracy"),
        "final_accuracy": evals[-1] if evals else None,
        "warm_start_heldout_expression_rate": prep.get("heldout_expression_rate"),
        "warm_start_heldout_literal_rate": prep.get("heldout_literal_rate"),
        "train_reward_mean_first_step": first.get("reward_mean"),
        "train_reward_mean_last_step": last.get("reward_mean"),
        "code_outcomes_first_step": {o: first.get(f"code_{o}") for o in OUTCOMES},
        "code_outcomes_last_step": {o: last.get(f"code_{o}") for o in OUTCOMES},
        "step1_iw_mean": first.get("iw_mean"),
        "step1_logprob_abs_diff_max": first.get("logprob_abs_diff_max"),
    }


def run_on(stack: LocalStack, spec: dict, *, prep: dict, cached: bool, console: Console, t0: float,
           load_before: tuple[float, float, float]) -> tuple[Path, dict]:
    """Submit `spec` to a running stack, wait, write the run's files into stack.run_dir."""
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
    summary = summarize(run, metrics, prep)
    summary.update({
        "warm_start_cached": cached, "warm_start_s": round(prep["seconds"], 2), "rl_s": round(rl_seconds, 2),
        "wall_s": round(time.monotonic() - t0, 2),
        "loadavg_before": [round(v, 2) for v in load_before], "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "cpu_count": os.cpu_count(), f"s_to_accuracy_gain_{GAIN}": gain.seconds,
    })
    return write_outputs(run, metrics, summary, stack.run_dir, console), summary


def spec_for(recipe: str | Path, overrides: dict, model_dir: Path, problems_path: str) -> dict:
    spec = load_recipe(recipe, overrides)
    spec["model_path"] = str(model_dir)
    spec["task"]["options"]["path"] = problems_path
    return spec


def main(argv: list[str] | None = None) -> int:
    from recipes.tiny_code import WARM_START

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None, help="Logs, checkpoints and the summary (default runs/demo-code-<time>).")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--seed", type=int, default=None, help="Override the recipe's seed (also seeds the warm start).")
    p.add_argument("--steps", type=int, default=None, help="Override the recipe's step count.")
    p.add_argument("--models-dir", default="runs/models", help="Where warm-started models are cached.")
    args = p.parse_args(argv)
    console = Console()
    t0, load_before = time.monotonic(), os.getloadavg()
    run_dir = Path(args.run_dir or f"runs/demo-code-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = {k: v for k, v in (("seed", args.seed), ("steps", args.steps)) if v is not None}
    seed = load_recipe(args.recipe, overrides)["seed"]
    models = Path(args.models_dir).resolve()
    model_dir = models / f"tiny_code-{warm_start_fingerprint(seed, WARM_START)}"
    prep, cached = prepare_model(model_dir, seed, dataclasses.replace(WARM_START), console)
    console.print(f"warm start{' (cached)' if cached else ''}: held-out greedy writes the expression for "
                  f"{prep['heldout_expression_rate']:.2f}, the literal for {prep['heldout_literal_rate']:.2f} "
                  f"({prep['seconds']:.0f}s to build)")
    spec = spec_for(args.recipe, overrides, model_dir, prep["problems_path"])
    with LocalStack(run_dir, path_roots=[models]) as stack:
        console.print(f"services up: coordinator {stack.api_url}, logs in {run_dir / 'logs'}")
        path, summary = run_on(stack, spec, prep=prep, cached=cached, console=console, t0=t0, load_before=load_before)
    print(path)
    return 0 if summary["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
