"""Build the tool demo's policy: tiny Qwen3 + char tokenizer + a short supervised warm start.

    python -m recipes.tiny_tools.prepare --out DIR --seed S

writes a Hugging Face model directory that the trainer, the rollout and the coordinator all load, and
prints one JSON line: the held-out greedy tool-use report (accuracy, tool-call rate, correct-tool-call
rate), warm-start steps, seconds.

The warm start trains on scripted calculator episodes (recipes/tiny_tools/episodes.py): a small share
calls the tool, the rest answer directly (see recipes/tiny_tools/__init__.py for why). The loss covers
the model's tokens only; the calculator's `<result>` is context, as it is in RL.

Deterministic: the model init, the batch order and the episode mix are functions of the seed; the thread
count is pinned. Two runs with the same seed on the same machine write bitwise-identical weights.
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

from recipes.char_tokenizer import build_char_tokenizer
from recipes.tiny_model import TinyQwen3Config, build_tiny_qwen3, save_model_dir
from recipes.tiny_tools import MODEL, TASK_OPTIONS, WARM_START, WarmStartConfig
from recipes.tiny_tools.episodes import IGNORE, ToolUseReport, greedy_tool_use, scripted_batches
from services.common.determinism import configure_determinism
from services.coordinator.tasks.episodic import CalculatorConfig, CalculatorTask

TURN_TOKENS = 24
"""Most tokens in one greedy turn of the held-out check (the recipe's rollout.sampling.max_new_tokens)."""


def heldout_report(model, tokenizer, task: CalculatorTask, size: int | None = None) -> ToolUseReport:
    """Greedy episodes of the first `size` held-out problems (all by default), the run's eval's order."""
    limits = TASK_OPTIONS["episode"]
    problems = task.split("heldout")
    return greedy_tool_use(model, tokenizer, problems[:size] if size else problems, max_turns=limits["max_turns"],
                           max_new_tokens=TURN_TOKENS, max_episode_tokens=limits["max_episode_tokens"])


def warm_start(model, tokenizer, task: CalculatorTask, cfg: WarmStartConfig, *, seed: int) -> float:
    """`cfg.steps` supervised steps on scripted train episodes; returns the last step's loss."""
    cfg.validate()
    train = task.split("train")
    rng = random.Random(f"tiny-tools-warm-start/{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    loss_value = float("nan")
    model.train()
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.warmup_steps))
        problems = [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)]
        # The mean over every model token of the step, summed over its batches (one per episode kind).
        batches = scripted_batches(tokenizer, problems, rng, cfg.tool_fraction)
        tokens = sum(int((lab[:, 1:] != IGNORE).sum()) for _, lab in batches)
        loss = 0.0
        for ids, lab in batches:
            # Right padding needs no attention mask: under causal attention a pad only follows loss tokens.
            logits = model(input_ids=ids).logits
            loss = loss + F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                                          ignore_index=IGNORE, reduction="sum") / tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def prepare(out_dir: str | Path, *, seed: int, model_cfg: TinyQwen3Config = MODEL,
            warm: WarmStartConfig = WARM_START, heldout_size: int | None = None) -> dict:
    """Build, warm-start and save the demo policy; returns the facts prepare prints."""
    t0 = time.monotonic()
    configure_determinism(seed, num_threads=warm.num_threads)
    task = CalculatorTask(CalculatorConfig.model_validate(TASK_OPTIONS, strict=False))
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen3(model_cfg, seed=seed)
    loss = warm_start(model, tokenizer, task, warm, seed=seed)
    report = heldout_report(model, tokenizer, task, heldout_size)
    out = save_model_dir(model, out_dir)
    return {
        "model_dir": str(Path(out).resolve()),
        "seed": seed,
        **report.as_dict("heldout_"),
        "heldout_size": report.episodes,
        "warm_start_steps": warm.steps,
        "final_loss": round(loss, 6),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Model directory to write (created if missing).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the model init, batch order and episode mix.")
    p.add_argument("--steps", type=int, default=None, help=f"Override the step count ({WARM_START.steps}).")
    p.add_argument("--tool-fraction", type=float, default=None,
                   help=f"Override the share of tool-calling episodes ({WARM_START.tool_fraction}).")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"Override the episodes per step ({WARM_START.batch_size}).")
    p.add_argument("--threads", type=int, default=None, help=f"torch threads ({WARM_START.num_threads}).")
    p.add_argument("--heldout-size", type=int, default=None,
                   help="Report on the first N held-out problems (default: all).")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("steps", args.steps), ("tool_fraction", args.tool_fraction),
                                   ("batch_size", args.batch_size), ("num_threads", args.threads)) if v is not None}
    warm = dataclasses.replace(WARM_START, **overrides)
    try:
        warm.validate()
    except ValueError as exc:
        p.error(str(exc))
    if args.heldout_size is not None and args.heldout_size < 1:
        p.error(f"--heldout-size: must be >= 1, got {args.heldout_size}")
    print(json.dumps(prepare(args.out, seed=args.seed, warm=warm, heldout_size=args.heldout_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
