"""An in-process replica of the tiny_judge run, for trying reward-model and recipe settings in a minute.

    .venv/bin/python -m recipes.tiny_judge.replica POLICY_DIR REWARD_MODEL_DIR [--reward rule] [--seed S]

One process, no services: each step samples 32 train prompts x 8 answers from the policy at temperature 1
(HF generate), scores them with the reward model (or the task's rule, for comparison), takes GRPO group
advantages (contract.advantages, as the coordinator does) and one on-policy step of the token-mean policy
gradient with the recipe's AdamW settings. Held-out greedy accuracy every 25 steps, by the rule. It approximates
the recipe's loop (no PPO clip, which an on-policy single update never reaches; HF sampling, not the engine's),
so its curves are a guide to settings; the recipe's learning test through the real stack is the measure.
Prints one JSON line per evaluation and a last one with the whole curve.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
import torch.nn.functional as F

from contract.advantages import group_advantages
from recipes.char_tokenizer import EOS_ID, PAD_ID, build_char_tokenizer
from recipes.tiny_arith import TASK_OPTIONS
from recipes.tiny_arith.prepare import greedy_accuracy
from recipes.tiny_judge.reward_model import load_policy, render, scores
from services.common.determinism import configure_determinism
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

PROMPTS, SAMPLES, MAX_NEW_TOKENS = 32, 8, 5  # recipe.yaml's rollout section
LR, BETAS, GRAD_CLIP, EVAL_EVERY = 3e-4, (0.9, 0.99), 1.0, 25  # its trainer and eval sections


@torch.no_grad()
def sample_step(policy, tokenizer, problems) -> list[tuple[object, list[int], list[int]]]:
    """(problem, prompt ids, response ids ending at eos when one was written) for SAMPLES answers each."""
    policy.eval()
    out = []
    by_len: dict[int, list] = {}
    for p in problems:
        by_len.setdefault(len(tokenizer.encode(p.prompt, add_special_tokens=False)), []).append(p)
    for _, group in sorted(by_len.items()):
        prompt_ids = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in group]
        ids = torch.tensor([row for row in prompt_ids for _ in range(SAMPLES)])
        made = policy.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        for row, tokens in enumerate(made[:, ids.shape[1]:].tolist()):
            tokens = tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens
            out.append((group[row // SAMPLES], prompt_ids[row // SAMPLES], tokens))
    return out


def policy_gradient_step(policy, optimizer, rollouts, advantages: list[float]) -> None:
    """One token-mean policy-gradient step on the response tokens (eos included)."""
    policy.train()
    width = max(len(prompt) + len(response) for _, prompt, response in rollouts)
    ids = torch.full((len(rollouts), width), PAD_ID)
    attention = torch.zeros((len(rollouts), width), dtype=torch.long)
    scored = torch.zeros((len(rollouts), width))
    for row, (_, prompt, response) in enumerate(rollouts):
        end = len(prompt) + len(response)
        ids[row, :end], attention[row, :end], scored[row, len(prompt):end] = torch.tensor(prompt + response), 1, 1
    logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:, None])[..., 0]
    mask = scored[:, 1:]
    loss = -(torch.tensor(advantages)[:, None] * logprobs * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_CLIP)
    optimizer.step()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", help="The warm-started policy directory.")
    p.add_argument("reward_model", help="The reward model directory (unused with --reward rule).")
    p.add_argument("--reward", choices=("reward_model", "rule"), default="reward_model")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="Seeds prompt order and sampling.")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    configure_determinism(args.seed, num_threads=args.threads)
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_char_tokenizer()
    task = ArithmeticTask(ArithmeticConfig(**TASK_OPTIONS))
    train, heldout = list(task.split("train")), list(task.split("heldout"))
    policy = load_policy(args.policy)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model) \
        if args.reward == "reward_model" else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    rng = random.Random(args.seed)
    curve, began = [(0, greedy_accuracy(policy, tokenizer, task, heldout))], time.monotonic()
    for step in range(1, args.steps + 1):
        rollouts = sample_step(policy, tokenizer, [rng.choice(train) for _ in range(PROMPTS)])
        texts = [tokenizer.decode([t for t in response if t != EOS_ID]) for _, _, response in rollouts]
        if reward_model is None:
            rewards = [task.reward(problem, text) for (problem, _, _), text in zip(rollouts, texts)]
        else:
            rewards = scores(reward_model, [(render(tokenizer, problem.prompt, text), 0.0)
                                            for (problem, _, _), text in zip(rollouts, texts)]).tolist()
        groups = [f"{i // SAMPLES}" for i in range(len(rollouts))]  # sample_step keeps a prompt's answers together
        policy_gradient_step(policy, optimizer, rollouts, group_advantages(rewards, groups))
        if step % EVAL_EVERY == 0:
            curve.append((step, greedy_accuracy(policy, tokenizer, task, heldout)))
            print(json.dumps({"step": step, "heldout_accuracy": curve[-1][1],
                              "seconds": round(time.monotonic() - began, 1)}), flush=True)
    print(json.dumps({"args": vars(args), "curve": curve,
                      "best_gain": round(max(acc for _, acc in curve) - curve[0][1], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
