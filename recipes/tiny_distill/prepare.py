"""Build the distillation demo's teacher and student in code.

    .venv/bin/python -m recipes.tiny_distill.prepare --out runs/tiny_distill --seed 0

writes <out>/teacher (recipes.tiny_distill.TEACHER, warm-started to 90% train-probe accuracy) and
<out>/student (the demo's warm start, recipes.tiny_arith.prepare), and prints one JSON line with both
held-out accuracies (the task's 200 held-out problems, greedy).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.tiny_arith.prepare import prepare as warm_start
from recipes.tiny_distill import TEACHER, TEACHER_WARM_START


def prepare_teacher(out: str | Path, *, seed: int) -> dict:
    return warm_start(out, seed=seed, model_cfg=TEACHER, warm=TEACHER_WARM_START)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Directory to write teacher/ and student/ into.")
    p.add_argument("--seed", type=int, default=0, help="Seeds both models' init and warm-start batches.")
    p.add_argument("--teacher-only", action="store_true", help="Build the teacher alone (the student is the "
                   "demo's warm start, `python -m recipes.tiny_arith.prepare`).")
    args = p.parse_args(argv)
    out = Path(args.out)
    report = {"teacher": prepare_teacher(out / "teacher", seed=args.seed)}
    if not args.teacher_only:
        report["student"] = warm_start(out / "student", seed=args.seed)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
