"""Async RL learning band: does the CPU demo learn as well with stale rollouts as synchronously?

Runs the tiny_arith demo's recipe (recipes/tiny_arith/recipe.yaml: warm-started model, 32 prompts x 8
samples, its learning rate and clip) through the real services (trainer, rollout replica and coordinator
as separate processes, one LocalStack for every run) once per configuration and seed:

- sync: async.max_staleness 0, the recipe as it is;
- fixed_lag K = 1, 2 and streaming K = 1, 2: the same recipe with that `async` section and
  trainer.mismatch_correction 'truncate' (decoupled PPO with TIS, which a run with K > 0 needs), or
  another correction named as `fixed_lag:2:m2po` (CORRECTIONS).

Every run trains the same number of steps on the same batch, so equal samples; mid-run evaluations are
off in every run (a run with K > 0 refuses them), and the held-out greedy accuracy after the last step
(the task's 200 held-out problems) is the figure compared. Each seed warm-starts its own model
(recipes.tiny_arith.demo, cached under runs/models) and seeds the run.

The synchronous band is [min, max] of the sync runs' final accuracies over the seeds. A configuration is
within the band when the mean of its seeds' accuracies lies in it; each seed's own in-band flag is kept
too. With one seed the band is a single point, so a smoke run says little beyond that everything runs.

`--jobs N` runs up to N (configuration, seed) runs at once, each in its own LocalStack (run_dir, ports and
embedded Redis of its own), after every seed's model is warm-started (once per seed, those in parallel
too): a run's result does not depend on what runs beside it, only its wall time does. With --jobs 1 (the
default) every run goes through one LocalStack in turn.

    python bench/async_learning.py --seeds 0,1,2 --out bench/results/async_learning_cpu.json
    python bench/async_learning.py --jobs 15 --out bench/results/async_learning_cpu.json   # 16 cores
    python bench/async_learning.py --lr 1.5e-4 --jobs 2 --out bench/results/async_learning_cpu_lr15.json

`--lr` sets every run's learning rate, sync included (the band is then that learning rate's own): how far the
policy moves per step decides how stale a rollout a correction can still use. A configuration's own rate
follows it after '@' (`fixed_lag:2@1.5e-4`), e.g. to compare K = 2 at half the rate with the synchronous
recipe as it is:

    python bench/async_learning.py --configs sync,fixed_lag:2@1.5e-4,streaming:2@1.5e-4 --jobs 2

Writes one JSON object (to --out, and prints it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from recipes.tiny_arith.demo import RECIPE, prepare_model, warm_start_fingerprint
from services.cli.client import load_recipe
from services.local_stack import LocalStack

CONFIGS = ("sync", "fixed_lag:1", "fixed_lag:2", "streaming:1", "streaming:2")


# How a K > 0 configuration corrects for its stale rollouts: `mode:K:NAME`; without NAME, 'truncate'.
CORRECTIONS = {
    "truncate": {"mismatch_correction": {"mode": "truncate"}},  # decoupled PPO, token-level TIS (cap 2)
    "mask": {"mismatch_correction": {"mode": "mask"}},  # decoupled PPO, token-level MIS ([1/2, 2])
    "geo": {"mismatch_correction": {"mode": "truncate", "level": "geometric"}},  # TIS on each sequence's geometric mean
    "m2po": {"policy_loss": {"kind": "m2po"}},  # M2PO's own objective against the behaviour policy
    # truncate at lr / max(1, mean token staleness): staleness-aware SGD (trainer.lr_schedule)
    "truncate_lr": {"mismatch_correction": {"mode": "truncate"}, "lr_schedule": {"staleness_scaling": "inverse"}},
}


def parse_config(text: str) -> tuple[str, int, str, float | None]:
    """'sync' -> (fixed_lag, 0, none, None); 'mode:K[:correction][@lr]' -> (mode, K, correction, lr or None)."""
    body, _, lr_text = text.partition("@")
    try:
        lr = float(lr_text) if lr_text else None
    except ValueError:
        lr = -1.0
    if lr is not None and not lr > 0:
        raise SystemExit(f"--configs: {text!r}: the learning rate after '@' must be a positive number")
    if body == "sync":
        return "fixed_lag", 0, "none", lr
    mode, _, rest = body.partition(":")
    k, _, correction = rest.partition(":")
    correction = correction or "truncate"
    if mode not in ("fixed_lag", "streaming") or not k.isdigit() or int(k) < 1 or correction not in CORRECTIONS:
        raise SystemExit(f"--configs: {text!r} is not 'sync' or 'fixed_lag:K[:C]' / 'streaming:K[:C]' with K >= 1 "
                         f"and C one of {sorted(CORRECTIONS)}, each with an optional '@lr'")
    return mode, int(k), correction, lr


def run_spec(model: Path, seed: int, steps: int, mode: str, k: int, correction: str,
             lr: float | None = None) -> dict:
    spec = load_recipe(str(RECIPE), {"seed": seed, "steps": steps})
    if lr is not None:
        spec["trainer"]["lr"] = lr
    spec["model_path"] = str(model)
    spec["name"] = f"async-learning-{mode}-k{k}-{correction}-seed{seed}"
    spec["eval"]["every"] = 0  # the same for every configuration: K > 0 refuses mid-run evaluations
    spec["async"] = {"max_staleness": k, "mode": mode}
    if k > 0:
        spec["trainer"].update(CORRECTIONS[correction])
    return spec


def train(client, spec: dict) -> dict:
    began = time.monotonic()
    run = client.submit(spec)
    done = client.wait(run["id"], timeout_s=7200)
    if done["status"] != "completed":
        raise SystemExit(f"{spec['name']}: run ended {done['status']}: {done.get('error')}")
    metrics = client.metrics(run["id"])
    steps = [s["metrics"] for s in metrics["steps"]]
    final = steps[-1].get("eval_accuracy")
    if final is None:
        raise SystemExit(f"{spec['name']}: the last step recorded no eval_accuracy")
    return {
        "final_accuracy": final,
        "initial_accuracy": (metrics.get("eval_initial") or {}).get("accuracy"),
        "trajectories_trained": sum(m.get("trajectories_trained", 0) for m in steps),
        "trajectories_dropped_stale": sum(m.get("trajectories_dropped_stale", 0) for m in steps),
        "token_staleness_max": max((m.get("token_staleness_max", 0.0) for m in steps), default=0.0),
        "diagnostics": step_diagnostics(steps, spec["trainer"].get("grad_clip")),
        "run_wall_s": round(time.monotonic() - began, 1),
    }


def step_diagnostics(steps: list[dict], grad_clip: float | None) -> dict:
    """Means over the run's steps of what tells a stale run's updates from a synchronous one's: how far the
    trainer's policy is from the behaviour policy (IW, k3), how much of the step the correction or M2PO
    changed, and how often the gradient was clipped; the reward of the first and last 25 steps."""
    def mean(key: str, rows: list[dict] = steps) -> float | None:
        values = [m[key] for m in rows if key in m]
        return round(statistics.mean(values), 6) if values else None
    out = {key: mean(key) for key in ("iw_mean", "iw_max", "approx_kl_k3", "is_weight_mean", "is_affected_fraction",
                                      "m2po_masked_fraction", "clip_fraction", "grad_norm")}
    if grad_clip:
        out["grad_clipped_steps_fraction"] = round(statistics.mean(
            float(m.get("grad_norm", 0.0) > grad_clip) for m in steps), 4)
    out["reward_mean_first_25"] = mean("reward_mean", steps[:25])
    out["reward_mean_last_25"] = mean("reward_mean", steps[-25:])
    return out


def report(console: Console, name: str, seed: int, r: dict) -> None:
    """One line per finished run, then its record as JSON: a log cut short still holds every finished run."""
    console.print(f"{name} seed {seed}: final accuracy {r['final_accuracy']:.3f} ({r['run_wall_s']:.0f}s)")
    console.print(json.dumps({"config": name, "seed": seed, **r}), soft_wrap=True, highlight=False, markup=False)


def band_report(results: dict[str, dict[int, dict]]) -> dict:
    """The sync band and, per configuration, its mean and whether it (and each seed) lies inside it."""
    sync = [r["final_accuracy"] for r in results["sync"].values()]
    low, high = min(sync), max(sync)
    out = {"sync_band": [low, high], "rule": "a configuration is within the band when the mean of its seeds' "
           "final accuracies lies in [min, max] of the sync seeds' final accuracies", "configs": {}}
    for name, by_seed in results.items():
        accs = [r["final_accuracy"] for r in by_seed.values()]
        mean = statistics.mean(accs)
        out["configs"][name] = {
            "final_accuracy_mean": round(mean, 4),
            "final_accuracy_by_seed": {str(s): r["final_accuracy"] for s, r in by_seed.items()},
            "within_sync_band": low <= mean <= high,
            "seeds_within_sync_band": {str(s): low <= r["final_accuracy"] <= high for s, r in by_seed.items()},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run (and warm-start) seeds")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: the recipe's)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: sync, fixed_lag:K[:C], "
                        "streaming:K[:C], C a correction of CORRECTIONS, truncate by default, each with an optional "
                        "'@lr' of its own (sync is required: it makes the band)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of every run, sync included (default: the recipe's)")
    parser.add_argument("--models-dir", type=Path, default=Path("runs/models"),
                        help="where the warm-started models are cached (as make demo caches them)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each service")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own LocalStack")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="free text kept in the output (e.g. how loaded the host was)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs: must be >= 1, got {args.jobs}")
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    if "sync" not in configs:
        raise SystemExit("--configs: must include 'sync' (the band every other configuration is compared with)")
    parsed = {c: parse_config(c) for c in configs}

    def lr_of(name: str) -> float | None:
        """The configuration's own '@lr', else --lr, else (None) the recipe's."""
        return parsed[name][3] if parsed[name][3] is not None else args.lr
    recipe = load_recipe(str(RECIPE))
    steps = args.steps or recipe["steps"]
    batch = recipe["rollout"]["prompts_per_step"] * recipe["rollout"]["samples_per_prompt"]
    console = Console(stderr=True)
    began = time.monotonic()
    models_dir = args.models_dir.resolve()
    models = {seed: models_dir / f"tiny_arith-{warm_start_fingerprint(seed)}" for seed in seeds}
    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, len(seeds)))) as pool:  # one process per seed
        list(pool.map(lambda seed: prepare_model(models[seed], seed, console), seeds))
    warm_start_s = time.monotonic() - began
    runs = [(name, seed) for seed in seeds for name in configs]
    done: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-learning-") as tmp:
        if args.jobs == 1:
            with LocalStack(Path(tmp) / "stack", path_roots=[models_dir], num_threads=args.threads) as stack:
                client = stack.client()
                try:
                    for name, seed in runs:
                        spec = run_spec(models[seed], seed, steps, *parsed[name][:3], lr=lr_of(name))
                        done[name, seed] = train(client, spec)
                        report(console, name, seed, done[name, seed])
                finally:
                    client.close()
        else:
            def started(name: str, seed: int) -> LocalStack:
                """A started stack of its own. Each stack's services pick some ports in their own processes
                (the coordinator its Redis's, the trainer its rendezvous'), so with N stacks starting at once
                two processes can pick the same one: such a start is retried in a fresh directory, with fresh
                ports. Nothing has run on it yet, so a retry changes no result."""
                for attempt in range(3):
                    stack = LocalStack(Path(tmp) / f"{name.replace(':', '-')}-seed{seed}-start{attempt}",
                                       path_roots=[models_dir], num_threads=args.threads)
                    try:
                        stack.start(timeout_s=600)  # N stacks importing torch at once start slower than one
                        return stack
                    except RuntimeError as exc:
                        stack.stop()
                        if "Address already in use" not in str(exc) or attempt == 2:
                            raise
                        console.print(f"{name} seed {seed}: a port was taken during the start; starting again")
                raise AssertionError("unreachable")

            def one(run: tuple[str, int]) -> None:
                name, seed = run
                stack = started(name, seed)
                try:
                    client = stack.client()
                    try:
                        done[run] = train(client, run_spec(models[seed], seed, steps, *parsed[name][:3],
                                                           lr=lr_of(name)))
                    finally:
                        client.close()
                finally:
                    stack.stop()
                report(console, name, seed, done[run])

            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                list(pool.map(one, runs))  # re-raises the first run's failure
    results = {name: {seed: done[name, seed] for seed in seeds} for name in configs}
    out = {
        "bench": "async_learning", "note": args.note, "device": "cpu", "host": platform.node(),
        "cpus": os.cpu_count(), "threads_per_service": args.threads, "recipe": "recipes/tiny_arith/recipe.yaml",
        "steps": steps, "lr": args.lr or recipe["trainer"]["lr"], "seeds": seeds, "samples_per_run": steps * batch,
        "lr_by_config": {name: lr_of(name) or recipe["trainer"]["lr"] for name in configs},
        "async_corrections": {name: CORRECTIONS[parsed[name][2]] for name in configs if parsed[name][1] > 0},
        "jobs": args.jobs, "warm_start_s": round(warm_start_s, 1),
        "wall_s": round(time.monotonic() - began, 1), "loadavg_end": os.getloadavg(),
        "runs": {name: {str(s): r for s, r in by_seed.items()} for name, by_seed in results.items()},
        **band_report(results),
    }
    text = json.dumps(out, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
