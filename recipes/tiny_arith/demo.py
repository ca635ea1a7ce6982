"""`make demo`: the whole product on a laptop CPU, end to end.

1. Build the tiny Qwen3 policy and its tokenizer in code and give it a short
   supervised warm start (recipes.tiny_arith.prepare), cached per seed.
2. Start the real services on loopback: trainer, rollout, coordinator (which
   starts an embedded Redis).
3. Submit recipe.yaml through the REST API and show live progress.
4. Write summary.json, metrics.json and a plot into the run directory; print a
   summary table; the last line printed is the path of summary.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.cli.client import load_recipe
from services.cli.progress import RunProgress
from services.local_stack import LocalStack

RECIPE = Path(__file__).with_name("recipe.yaml")


def warm_start_fingerprint(seed: int, moe: bool = False) -> str:
    """Names the cached model dir: the seed and every setting that shapes the warm-started weights."""
    from recipes.tiny_arith import MODEL, MOE_MODEL, TASK_OPTIONS, WARM_START

    text = repr((seed, MOE_MODEL if moe else MODEL, WARM_START, sorted(TASK_OPTIONS.items())))
    return f"seed{seed}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def prepare_model(out: Path, seed: int, console: Console, moe: bool = False) -> dict:
    """Warm-started model dir, built once per fingerprint (deterministic, so the cache is exact)."""
    stamp = out / "prepare.json"
    if stamp.exists():
        return json.loads(stamp.read_text())
    console.print(f"building the tiny Qwen3 policy and its supervised warm start -> {out}")
    proc = subprocess.run([sys.executable, "-m", "recipes.tiny_arith.prepare", "--out", str(out), "--seed", str(seed),
                           *(["--moe"] if moe else [])], check=True, capture_output=True, text=True)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    stamp.write_text(json.dumps(info))
    return info


def summarize(run: dict, metrics: dict, wall_seconds: float, rl_seconds: float) -> dict:
    steps = metrics["steps"]
    evals = [(s["step"], s["metrics"]["eval_accuracy"]) for s in steps if "eval_accuracy" in s["metrics"]]
    first = steps[0]["metrics"] if steps else {}
    return {
        "run_id": run["id"],
        "status": run["status"],
        "steps": len(steps),
        "initial_accuracy": (metrics.get("eval_initial") or {}).get("accuracy"),
        "final_accuracy": evals[-1][1] if evals else None,
        "step1_iw_mean": first.get("iw_mean"),
        "step1_logprob_abs_diff_max": first.get("logprob_abs_diff_max"),
        "wall_seconds": round(wall_seconds, 2),
        "rl_seconds": round(rl_seconds, 2),
    }


def plot(metrics: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = metrics["steps"]
    x = [s["step"] for s in steps]
    m = [s["metrics"] for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(x, [v["reward_mean"] for v in m])
    axes[0].set_title("reward mean")
    ev = [(0, metrics["eval_initial"]["accuracy"])] if metrics.get("eval_initial") else []
    ev += [(s["step"], s["metrics"]["eval_accuracy"]) for s in steps if "eval_accuracy" in s["metrics"]]
    axes[1].plot([e[0] for e in ev], [e[1] for e in ev], marker="o")
    axes[1].set_title("held-out greedy accuracy")
    axes[1].set_ylim(0, 1)
    axes[2].plot(x, [v["iw_mean"] for v in m], label="mean")
    axes[2].fill_between(x, [v["iw_min"] for v in m], [v["iw_max"] for v in m], alpha=0.3, label="min..max")
    axes[2].set_title("importance weight exp(logp - rollout_logp)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(summary: dict, metrics: dict) -> Table:
    t = Table(title=f"run {summary['run_id']} ({summary['status']})")
    for col in ("step", "reward", "held-out acc", "IW mean", "IW max", "|Δlogp| max", "KL k3"):
        t.add_column(col, justify="right")
    steps = metrics["steps"]
    shown = {s["step"] for s in steps if "eval_accuracy" in s["metrics"]} | {1}
    for s in steps:
        if s["step"] in shown:
            m = s["metrics"]
            t.add_row(str(s["step"]), f"{m['reward_mean']:.3f}", f"{m['eval_accuracy']:.3f}" if "eval_accuracy" in m else "-",
                      f"{m['iw_mean']:.6f}", f"{m['iw_max']:.4f}", f"{m['logprob_abs_diff_max']:.2e}",
                      f"{m['approx_kl_k3']:.2e}")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=None, help="Where logs, checkpoints and the summary go (default runs/demo-<time>).")
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--seed", type=int, default=None, help="Override the recipe's seed.")
    p.add_argument("--steps", type=int, default=None, help="Override the recipe's step count.")
    p.add_argument("--moe", action="store_true", help="A Qwen3-MoE policy (8 experts, top-2; docs/moe.md).")
    args = p.parse_args(argv)
    console = Console()
    t0 = time.monotonic()
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = {k: v for k, v in (("seed", args.seed), ("steps", args.steps)) if v is not None}
    spec = load_recipe(args.recipe, overrides)
    model_dir = Path("runs/models").resolve() / f"tiny_arith-{warm_start_fingerprint(spec['seed'], args.moe)}"
    prep = prepare_model(model_dir, spec["seed"], console, args.moe)
    console.print(f"warm start: held-out greedy accuracy {prep.get('heldout_accuracy')} "
                  f"({prep.get('seconds', 0):.0f}s)")
    spec["model_path"] = str(model_dir)
    with LocalStack(run_dir, path_roots=[model_dir.parent]) as stack:
        console.print(f"services up: coordinator {stack.api_url}, logs in {run_dir / 'logs'}")
        client = stack.client()
        t_rl = time.monotonic()
        run = client.submit(spec)
        with RunProgress(console) as progress:
            run = client.wait(run["id"], poll_s=0.5, on_update=progress)
        rl_seconds = time.monotonic() - t_rl
        metrics = client.metrics(run["id"])
        client.close()
    summary = summarize(run, metrics, time.monotonic() - t0, rl_seconds)
    path = write_outputs(run, metrics, summary, run_dir, console)
    print(path)
    return 0 if run["status"] == "completed" else 1



def write_outputs(run: dict, metrics: dict, summary: dict, run_dir: Path, console: Console) -> Path:
    """metrics.json, the plot and summary.json in `run_dir`, the table and the summary on the console;
    the path of summary.json."""
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if metrics["steps"]:
        plot(metrics, run_dir / "plot.png")
        console.print(table(summary, metrics))
        summary["plot"] = str(run_dir / "plot.png")
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2))
    if run["status"] != "completed":
        console.print(f"[red]run {run['status']}: {run.get('error')}[/red]")
    console.print_json(json.dumps(summary))
    return path

if __name__ == "__main__":
    sys.exit(main())
