"""Write the SFT recipe's inputs: the untrained tiny policy and the task's train split as JSON Lines.

    .venv/bin/python -m recipes.tiny_arith_sft.prepare --out runs/tiny_arith_sft --seed 0

prints one JSON line: the model directory, the dataset file and how many examples it holds. The model is
`recipes.tiny_arith`'s shape built from `--seed` (what the code-built warm start trains), the pairs are
`{"prompt": "12+34=", "completion": "46"}` for every problem of the task's train split (TASK_OPTIONS), so
the run's held-out split is the demo's and disjoint from what it trains on.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.tiny_arith import MODEL, TASK_OPTIONS
from recipes.tiny_model import build_model_dir
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def prepare(out: str | Path, *, seed: int) -> dict:
    out = Path(out)
    model = build_model_dir(out / "model", MODEL, seed=seed)
    task = ArithmeticTask(ArithmeticConfig(**TASK_OPTIONS))
    train = task.split("train")
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, "completion": task.target_text(p)}) + "\n"
                            for p in train))
    return {"model_dir": str(model.resolve()), "dataset": str(data.resolve()), "examples": len(train)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Directory to write model/ and train.jsonl into.")
    p.add_argument("--seed", type=int, default=0, help="Seeds the model init (the warm start's --seed).")
    args = p.parse_args(argv)
    print(json.dumps(prepare(args.out, seed=args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
