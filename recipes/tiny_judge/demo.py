"""`python -m recipes.tiny_judge.demo`: the policy learns from a reward model alone, end to end on a CPU.

1. The demo's warm-started policy (recipes.tiny_arith.prepare, cached per seed) and the reward model trained
   on its backbone (recipes.tiny_judge.reward_model) are built in code.
2. The real services start on loopback: trainer, one policy replica, one scorer replica (role scorer, engine
   reward_model), the coordinator with its embedded Redis.
3. recipe.yaml is submitted through the REST API; the reward model's score is the only reward.
4. Printed at the end, as one JSON line: held-out accuracy before and after (the exact rule, which the policy
   never sees), the run's seconds, and how often the reward model and the rule agreed on the policy's samples
   (score > 0 read as "correct"), over the first and the last kept steps.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from services.cli.client import CoordinatorClient, load_recipe
from services.local_stack import LocalStack

RECIPE = Path(__file__).with_name("recipe.yaml")
PROMPT = re.compile(r"^(\d+)\+(\d+)=$")


def rule_agreement(client: CoordinatorClient, run_id: str, step: int) -> tuple[float, int]:
    """How often the reward model's score (> 0: correct) and the exact rule agree on a step's kept samples."""
    from services.coordinator.tasks.arithmetic import parse_answer

    samples = client.samples(run_id, step, limit=1000)["samples"]
    agree = 0
    for s in samples:
        a, b = map(int, PROMPT.match(s["prompt"]).groups())
        correct = parse_answer(s["response"]) == str(a + b)
        agree += (s["reward"] > 0) == correct
    return agree / max(1, len(samples)), len(samples)


def build_models(out: Path, seed: int) -> tuple[Path, Path, dict]:
    policy, reward_model = out / "policy", out / "reward_model"
    facts = {}
    for module, args, target in (("recipes.tiny_arith.prepare", ["--out", str(policy)], policy),
                                 ("recipes.tiny_judge.reward_model", ["--policy", str(policy), "--out",
                                                                      str(reward_model)], reward_model)):
        stamp = target / "prepare.json"
        if not stamp.exists():
            proc = subprocess.run([sys.executable, "-m", module, *args, "--seed", str(seed)], check=True,
                                  capture_output=True, text=True)
            stamp.write_text(proc.stdout.strip().splitlines()[-1])
        facts[target.name] = json.loads(stamp.read_text())
    return policy, reward_model, facts


def run_recipe(stack: LocalStack, spec: dict, timeout_s: float = 3600, stop_at_gain: float | None = None) -> dict:
    """Submit `spec`, wait for it, and report accuracy, seconds and reward-model/rule agreement. With
    `stop_at_gain`, the run is cancelled at the first evaluation whose held-out accuracy is that far above the
    initial one (what a learning test needs to know, sooner)."""
    client = stack.client()
    stopped: dict = {}

    def watch(run: dict) -> None:
        if stop_at_gain is None or stopped or run["status"] != "running" or run["step"] == watch.step:
            return
        watch.step = run["step"]
        initial = (client.run(run["id"]).get("eval_initial") or {}).get("accuracy")
        evals = [(s["step"], s["metrics"]["eval_accuracy"]) for s in client.metrics(run["id"])["steps"]
                 if "eval_accuracy" in s["metrics"]]
        reached = [(step, acc) for step, acc in evals if initial is not None and acc - initial >= stop_at_gain]
        if reached:
            stopped.update(step=reached[0][0])
            client.cancel(run["id"])
    watch.step = -1
    try:
        run = client.submit(spec)
        began = time.monotonic()
        done = client.wait(run["id"], poll_s=0.5, timeout_s=timeout_s, on_update=watch)
        seconds = time.monotonic() - began
        detail = client.run(run["id"])
        steps = client.metrics(run["id"])["steps"]
        kept = [s["step"] for s in steps]
        first, last = (rule_agreement(client, run["id"], kept[0]), rule_agreement(client, run["id"], kept[-1])) \
            if kept else ((0.0, 0), (0.0, 0))
    finally:
        client.close()
    evals = [s["metrics"]["eval_accuracy"] for s in steps if "eval_accuracy" in s["metrics"]]
    return {"run_id": run["id"], "status": done["status"], "error": detail.get("error"), "steps": len(steps),
            "initial_accuracy": (detail.get("eval_initial") or {}).get("accuracy"),
            "final_accuracy": evals[-1] if evals else None, "best_accuracy": max(evals, default=None),
            "stopped_at_step": stopped.get("step"), "run_seconds": round(seconds, 1),
            "reward_model_rule_agreement_first_step": round(first[0], 4),
            "reward_model_rule_agreement_last_step": round(last[0], 4), "samples_per_step": last[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None, help="Logs and services' data (default runs/tiny_judge-<time>).")
    p.add_argument("--models", default="runs/tiny_judge", help="Where the two models are built (cached).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="Override the recipe's step count.")
    args = p.parse_args(argv)
    models = Path(args.models).resolve()
    policy, reward_model, facts = build_models(models, args.seed)
    overrides = {"seed": args.seed, "model_path": str(policy), "reward.reward_model.model_path": str(reward_model),
                 **({"steps": args.steps} if args.steps else {})}
    spec = load_recipe(RECIPE, overrides)
    run_dir = Path(args.run_dir or f"runs/tiny_judge-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    with LocalStack(run_dir, path_roots=[models], scorers=[("services.rollout",)]) as stack:
        report = run_recipe(stack, spec)
    print(json.dumps({**report, "reward_model_probe_agreement": facts["reward_model"].get("probe_agreement")}))
    return 0 if report["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
