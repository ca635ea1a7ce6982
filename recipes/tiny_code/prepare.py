"""Build the code demo's problems and policy: problems.jsonl, tiny Qwen3 + char tokenizer, a short warm start.

    python -m recipes.tiny_code.prepare --out DIR --seed S

writes DIR/problems.jsonl (HumanEval format, every problem of recipes.tiny_code.problems()) and a Hugging
Face model directory in DIR, and prints one JSON line: the warm-started policy's held-out greedy responses
by form (the expression, the literal, anything else), warm-start steps, seconds.

The warm start trains on the code task's train split only (the same split the run's task draws from the
same file, seed and heldout_size): the response is `a<op>b` on `expression_fraction` of examples and the
shown value on the rest (see recipes/tiny_code/__init__.py for why). Deterministic per seed; the thread
count is pinned.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from recipes.tiny_arith.prepare import greedy_responses
from recipes.tiny_code import HELDOUT_SIZE, MODEL, PROBLEMS_FILE, SPLIT_SEED, WARM_START, WarmStartConfig, problems
from recipes.tiny_model import build_tiny_qwen3, save_model_dir
from services.common.determinism import configure_determinism
from services.coordinator.tasks.code import read_problems, split_problems

IGNORE = -100
RESPONSE_TOKENS = 8
"""Longest greedy response the report decodes (the recipe's rollout.sampling.max_new_tokens)."""


def write_problems(out_dir: Path) -> Path:
    path = out_dir / PROBLEMS_FILE
    keys = ("task_id", "prompt", "entry_point", "test")
    path.write_text("".join(json.dumps({k: row[k] for k in keys}) + "\n" for row in problems()))
    return path


def splits(path: Path) -> dict[str, list[dict]]:
    """The code task's train and held-out problems of `path` (its own split function), as problems() rows."""
    rows = {row["task_id"]: row for row in problems()}
    split = split_problems(read_problems(path, "path"), SPLIT_SEED, HELDOUT_SIZE)
    return {name: [rows[p.problem_id] for p in part] for name, part in split.items()}


def _batch(tokenizer, examples: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels for (prompt, response) pairs; loss on response + eos only."""
    rows, labels = [], []
    for prompt, response in examples:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(response, add_special_tokens=False) + [EOS_ID]
        rows.append(p + r)
        labels.append([IGNORE] * len(p) + r)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    lab = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, :len(r)] = torch.tensor(r)
        lab[i, :len(lb)] = torch.tensor(lb)
    return ids, lab


def warm_start(model, tokenizer, train: list[dict], cfg: WarmStartConfig, *, seed: int) -> float:
    cfg.validate()
    rng = random.Random(f"tiny-code-warm-start/{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    loss_value = float("nan")
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.warmup_steps))
        chosen = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        examples = [(row["prompt"], row["expression"] if rng.random() < cfg.expression_fraction else row["literal"])
                    for row in chosen]
        ids, lab = _batch(tokenizer, examples)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def response_forms(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """Shares of greedy responses that are the expression (correct), the literal, or anything else."""
    responses = greedy_responses(model, tokenizer, [row["prompt"] for row in rows], RESPONSE_TOKENS)
    n = max(len(rows), 1)
    expression = sum(r == row["expression"] for r, row in zip(responses, rows)) / n
    literal = sum(r == row["literal"] for r, row in zip(responses, rows)) / n
    return {"expression_rate": expression, "literal_rate": literal, "other_rate": 1.0 - expression - literal}


def prepare(out_dir: str | Path, *, seed: int, warm: WarmStartConfig = WARM_START) -> dict:
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configure_determinism(seed, num_threads=warm.num_threads)
    path = write_problems(out)
    split = splits(path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(MODEL, seed=seed)
    loss = warm_start(model, tokenizer, split["train"], warm, seed=seed)
    forms = response_forms(model, tokenizer, split["heldout"])
    save_model_dir(model, out)
    return {"model_dir": str(out.resolve()), "problems_path": str(path.resolve()), "seed": seed,
            **{f"heldout_{k}": v for k, v in forms.items()}, "heldout_size": len(split["heldout"]),
            "warm_start_steps": warm.steps, "final_loss": round(loss, 6), "seconds": round(time.monotonic() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Directory to write (problems.jsonl and the model).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the model init, batch order and answer mix.")
    p.add_argument("--steps", type=int, default=None, help=f"Override the step count ({WARM_START.steps}).")
    p.add_argument("--expression-fraction", type=float, default=None,
                   help=f"Override the share of expression answers ({WARM_START.expression_fraction}).")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("expression_fraction", args.expression_fraction))
                 if v is not None}
    warm = dataclasses.replace(WARM_START, **overrides)
    try:
        warm.validate()
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(prepare(args.out, seed=args.seed, warm=warm)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
