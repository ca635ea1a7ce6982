"""Build the demo's policy: tiny Qwen3 + char tokenizer + a short supervised warm start.

    python -m recipes.tiny_arith.prepare --out DIR --seed S

writes a Hugging Face model directory (config.json, model.safetensors,
tokenizer files) that the trainer, the rollout engines and the coordinator
all load, and prints one JSON line: held-out greedy accuracy, train-probe
accuracy, warm-start steps, seconds.

Why a warm start at all: from random weights the policy never writes a
correct sum, every GRPO group has reward 0 everywhere, and the advantages are
all zero. A short supervised phase teaches the format (digits then eos) and
some addition, and stops at partial accuracy (`WarmStartConfig`), leaving RL
a measurable job: raise held-out accuracy by reward alone.

Deterministic: the model init, the batch order and the stopping decision are
functions of the seed; the thread count is pinned. Two runs with the same seed
on the same machine write bitwise-identical weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from recipes.tiny_arith import MODEL, TASK_OPTIONS, WARM_START, WarmStartConfig
from recipes.tiny_model import TinyQwen3Config, build_tiny_qwen3, save_model_dir
from services.common.determinism import configure_determinism
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask
from services.coordinator.tasks.base import Problem

IGNORE = -100  # cross_entropy's ignore_index: prompt and padding positions carry no loss


@dataclass(frozen=True)
class WarmStartResult:
    steps: int
    """Optimizer steps taken."""
    train_probe_accuracy: float
    """Greedy accuracy on the train probe when the warm start stopped."""
    reached_target: bool
    """False when `max_steps` ran out first."""
    final_loss: float
    """Loss of the last step (nan when no step ran)."""


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def decode_tokens(model, ids: torch.Tensor, max_new_tokens: int,
                  pick: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """Each row of `ids` (prompts of one token length, no padding) continued by `pick` (last position's logits
    [rows, vocab] -> next token [rows]) for up to `max_new_tokens` tokens, each row cut before its eos.

    Rows are never padded, so a row's tokens cannot depend on which other rows share its batch. Each step
    re-runs the full forward (no KV cache): sequences are ~10 tokens, and this keeps the numerics those of a
    plain forward pass on any transformers version.
    """
    done = torch.zeros(len(ids), dtype=torch.bool)
    steps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        token = pick(model(input_ids=ids).logits[:, -1])
        token = torch.where(done, torch.full_like(token, PAD_ID), token)
        steps.append(token)
        done |= token == EOS_ID
        if bool(done.all()):
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    rows = torch.stack(steps, dim=1).tolist() if steps else [[] for _ in range(len(ids))]
    return [row[:row.index(EOS_ID)] if EOS_ID in row else row for row in rows]


def greedy_responses(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy continuation of each prompt, decoded up to (not including) eos; prompts grouped by token length
    (decode_tokens)."""
    was_training = model.training
    model.eval()
    encoded = [_encode(tokenizer, p) for p in prompts]
    out: list[str | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    for _, idx in sorted(by_len.items()):
        ids = torch.tensor([encoded[i] for i in idx], dtype=torch.long)
        for i, row in zip(idx, decode_tokens(model, ids, max_new_tokens, lambda logits: logits.argmax(-1))):
            out[i] = tokenizer.decode(row, skip_special_tokens=False)
    model.train(was_training)
    return [s if s is not None else "" for s in out]


def greedy_accuracy(model, tokenizer, task: ArithmeticTask, problems: Sequence[Problem]) -> float:
    """Fraction of `problems` whose greedy response earns reward 1."""
    if not problems:
        return 0.0
    max_new = max(len(_encode(tokenizer, task.target_text(p))) for p in problems) + 1  # + eos
    responses = greedy_responses(model, tokenizer, [p.prompt for p in problems], max_new)
    return sum(task.reward(p, r) for p, r in zip(problems, responses)) / len(problems)


def _batch(tokenizer, task: ArithmeticTask, problems: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels; labels are the next token on answer + eos positions only."""
    rows, labels = [], []
    for p in problems:
        prompt = _encode(tokenizer, p.prompt)
        target = _encode(tokenizer, task.target_text(p)) + [EOS_ID]
        rows.append(prompt + target)
        # labels[t] is the token predicted *at* position t (shifted below).
        labels.append([IGNORE] * len(prompt) + target)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    lab = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(l)] = torch.tensor(l)
    return ids, lab


def warm_start(model, tokenizer, task: ArithmeticTask, cfg: WarmStartConfig, *, seed: int) -> WarmStartResult:
    """Supervised training on train problems until the train probe reaches `cfg.target_accuracy`."""
    cfg.validate()
    train = task.split("train")
    probe = train[: cfg.probe_size]
    rng = random.Random(f"warm-start/{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    loss_value, acc, step = float("nan"), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.warmup_steps))
        ids, lab = _batch(tokenizer, task, [train[rng.randrange(len(train))] for _ in range(cfg.batch_size)])
        # Right padding needs no attention mask: under causal attention a pad
        # only ever follows the tokens that carry loss.
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_value = loss.item()
        if step % cfg.check_every == 0:
            acc = greedy_accuracy(model, tokenizer, task, probe)
            if acc >= cfg.target_accuracy:
                return WarmStartResult(step, acc, True, loss_value)
    if step == 0 or step % cfg.check_every:
        acc = greedy_accuracy(model, tokenizer, task, probe)
    model.eval()
    return WarmStartResult(step, acc, acc >= cfg.target_accuracy, loss_value)


def prepare(
    out_dir: str | Path,
    *,
    seed: int,
    model_cfg: TinyQwen3Config = MODEL,
    task_options: dict | None = None,
    warm: WarmStartConfig = WARM_START,
    moe: bool = False,
) -> dict:
    """Build, warm-start and save the demo policy (the MoE variant with `moe`); returns the facts prepare
    prints."""
    t0 = time.monotonic()
    configure_determinism(seed, num_threads=warm.num_threads)
    task = ArithmeticTask(ArithmeticConfig(**(TASK_OPTIONS if task_options is None else task_options)))
    tokenizer = build_char_tokenizer()
    if moe:
        from recipes.tiny_arith import MOE_MODEL
        from recipes.tiny_moe import build_tiny_moe

        model = build_tiny_moe(MOE_MODEL, seed=seed)
    else:
        model = build_tiny_qwen3(model_cfg, seed=seed)
    result = warm_start(model, tokenizer, task, warm, seed=seed)
    model.eval()
    heldout = task.split("heldout")
    heldout_acc = greedy_accuracy(model, tokenizer, task, heldout)
    out = save_model_dir(model, out_dir)
    return {
        "model_dir": str(Path(out).resolve()),
        "seed": seed,
        "heldout_accuracy": heldout_acc,
        "heldout_size": len(heldout),
        "train_probe_accuracy": result.train_probe_accuracy,
        "warm_start_steps": result.steps,
        "reached_target": result.reached_target,
        "final_loss": round(result.final_loss, 6),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Model directory to write (created if missing).")
    p.add_argument("--seed", type=int, default=0, help="Seeds the model init and the warm-start batch order.")
    p.add_argument("--max-steps", type=int, default=None, help=f"Override the step cap ({WARM_START.max_steps}).")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help=f"Override the train-probe stop accuracy ({WARM_START.target_accuracy}).")
    p.add_argument("--threads", type=int, default=None, help=f"torch threads ({WARM_START.num_threads}).")
    p.add_argument("--moe", action="store_true", help="The Qwen3-MoE policy (recipes.tiny_arith.MOE_MODEL).")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("max_steps", args.max_steps), ("target_accuracy", args.target_accuracy),
                                   ("num_threads", args.threads)) if v is not None}
    warm = dataclasses.replace(WARM_START, **overrides)
    try:
        warm.validate()
    except ValueError as exc:
        p.error(str(exc))
    info = prepare(args.out, seed=args.seed, warm=warm, moe=args.moe)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
