"""Build and train the tiny reward model in code.

    .venv/bin/python -m recipes.tiny_judge.reward_model --policy DIR --out DIR --seed S

reads the warm-started policy (recipes.tiny_arith.prepare), builds a Qwen3ForSequenceClassification (one
scalar head) on a copy of its backbone, trains it with a logistic loss on labelled answers to the task's train
problems, writes the model directory with the char tokenizer and the reward model's chat template, and prints
one JSON line: steps, seconds, and its agreement with the rule on answers it was not trained on.

The wrong answers it learns from are the ones RL will ask it about: half are the policy's own mistakes, sampled
from it at the recipe's temperature before training (as a real reward model is trained on its policy's
samples); the other half are the correct answer with one digit changed at a uniformly drawn position, or its
length changed, so no way of being wrong goes unseen. A reward model trained only on hand-made mistakes scored
most of the policy's real ones above zero, and a policy trained on it learned those instead of the sums.

The labels come from the task's rule; the policy never sees them, only the trained model's scores.
Deterministic: init, sampling, batch order and data are functions of the seed; the thread count is pinned.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes.char_tokenizer import PAD_ID, build_char_tokenizer, save_char_tokenizer
from recipes.tiny_arith import TASK_OPTIONS
from recipes.tiny_arith.prepare import decode_tokens
from recipes.tiny_judge import CHAT_TEMPLATE, TRAINING, RewardModelTraining
from services.common.determinism import configure_determinism
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask


def edited_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer to a sum made from the correct one: one digit changed at a position drawn uniformly, or
    (as if one more position) the length changed: the last or first digit dropped, a digit appended, or a single
    digit. Every wrong answer differs from the right one in its length or in at least one digit."""
    position = rng.randrange(len(answer) + 1)
    if position < len(answer):
        digit = str((int(answer[position]) + rng.randint(1, 9)) % 10)
        return answer[:position] + digit + answer[position + 1:]
    resized = {answer[:-1], answer[1:], answer + str(rng.randint(0, 9)), str(rng.randint(0, 9))} - {answer, ""}
    return rng.choice(sorted(resized))


@torch.no_grad()
def sampled_answers(policy, tokenizer, prompts: Sequence[str], cfg: RewardModelTraining,
                    generator: torch.Generator) -> dict[str, list[str]]:
    """`cfg.policy_samples` answers per prompt, sampled from the policy at `cfg.sample_temperature` (the
    distribution a GRPO step draws from), each decoded up to eos. Prompts of one token length share a batch
    without padding; every step re-runs the full forward, as the warm start's greedy decoding does."""
    def sample(logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float() / cfg.sample_temperature, -1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    policy.eval()
    encoded = {p: tokenizer.encode(p, add_special_tokens=False) for p in dict.fromkeys(prompts)}
    by_len: dict[int, list[str]] = {}
    for prompt, ids in encoded.items():
        by_len.setdefault(len(ids), []).append(prompt)
    out: dict[str, list[str]] = {}
    for _, group in sorted(by_len.items()):
        for start in range(0, len(group), cfg.sample_batch_prompts):
            chunk = group[start:start + cfg.sample_batch_prompts]
            ids = torch.tensor([encoded[p] for p in chunk for _ in range(cfg.policy_samples)], dtype=torch.long)
            for row, tokens in enumerate(decode_tokens(policy, ids, cfg.sample_max_new_tokens, sample)):
                out.setdefault(chunk[row // cfg.policy_samples], []).append(
                    tokenizer.decode(tokens, skip_special_tokens=False))
    return out


def render(tokenizer, prompt: str, response: str) -> list[int]:
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tokenizer.encode(tokenizer.apply_chat_template(chat, tokenize=False, chat_template=CHAT_TEMPLATE),
                            add_special_tokens=False)


def load_policy(policy_dir: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)


def build_from_policy(policy, extra_layers: int):
    """A one-label sequence classifier on a copy of the policy's backbone and `extra_layers` more layers that
    start as the identity; and the policy's own LM head, for the training loss only."""
    import copy

    from transformers import Qwen3ForSequenceClassification

    config = copy.deepcopy(policy.config)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + extra_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    config.num_labels, config.architectures, config.pad_token_id = 1, ["Qwen3ForSequenceClassification"], PAD_ID
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    model = Qwen3ForSequenceClassification(config)
    missing, unexpected = model.model.load_state_dict(policy.model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(tuple(f"layers.{i}." for i in range(layers, config.num_hidden_layers)))
                                  for k in missing), (missing, unexpected)
    for layer in model.model.layers[layers:]:
        torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
        torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    torch.nn.init.normal_(model.score.weight, std=0.02)  # drawn under the seed (prepare forks the RNG)
    return model, policy.lm_head, layers


def _batch(examples: list[tuple[list[int], float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (seq, _) in enumerate(examples):
        ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
    return ids, mask, torch.tensor([label for _, label in examples])


def pairs(tokenizer, problems, rng: random.Random, mistakes: dict[str, list[str]],
          policy_fraction: float) -> list[tuple[list[int], float]]:
    """Each problem's correct answer (label 1), then one wrong answer per problem (label 0), in that order. A
    wrong answer is one of the policy's own mistakes on the problem with probability `policy_fraction` (when it
    made any), else edited_answer()."""
    right = [(render(tokenizer, p.prompt, p.answer), 1.0) for p in problems]
    wrong = []
    for p in problems:
        own = mistakes.get(p.prompt, ())
        answer = rng.choice(own) if own and rng.random() < policy_fraction else edited_answer(p.answer, rng)
        wrong.append((render(tokenizer, p.prompt, answer), 0.0))
    return right + wrong


def policy_mistakes(samples: dict[str, list[str]], task: ArithmeticTask, problems) -> dict[str, list[str]]:
    """The sampled answers the task's rule marks wrong, per prompt."""
    return {p.prompt: [a for a in samples.get(p.prompt, ()) if task.reward(p, a) == 0.0] for p in problems}


@torch.no_grad()
def scores(model, examples: list[tuple[list[int], float]], batch: int = 512) -> torch.Tensor:
    """The model's score of each rendered example, `batch` examples a forward."""
    model.eval()
    out = []
    for start in range(0, len(examples), batch):
        ids, mask, _ = _batch(examples[start:start + batch])
        out.append(model(input_ids=ids, attention_mask=mask).logits[:, 0])
    return torch.cat(out)


def agreement(model, examples: list[tuple[list[int], float]]) -> tuple[float, float]:
    """On pairs(): how often the correct answer outscores the wrong one, and how often the score's sign
    (> 0: correct) agrees with the rule's label."""
    values, labels = scores(model, examples), torch.tensor([label for _, label in examples])
    n = len(examples) // 2
    return float((values[:n] > values[n:]).float().mean()), float(((values > 0).float() == labels).float().mean())


def sample_agreement(model, tokenizer, task: ArithmeticTask, problems, samples: dict[str, list[str]]) -> float:
    """How often the score's sign agrees with the rule on the policy's own sampled answers to `problems`: what
    the first RL step will ask the reward model."""
    rows = [(p, a) for p in problems for a in samples[p.prompt]]
    values = scores(model, [(render(tokenizer, p.prompt, a), 0.0) for p, a in rows])
    return float(sum((v > 0) == (task.reward(p, a) == 1.0) for v, (p, a) in zip(values.tolist(), rows)) / len(rows))


def train(model, lm_head, backbone_layers: int, tokenizer, task: ArithmeticTask, cfg: RewardModelTraining, *,
          seed: int, samples: dict[str, list[str]]) -> dict:
    train_split = list(task.split("train"))
    mistakes = policy_mistakes(samples, task, train_split)
    rng = random.Random(f"reward-model/{seed}")
    probe = pairs(tokenizer, train_split[:cfg.probe_size], random.Random(f"probe/{seed}"), mistakes,
                  cfg.policy_fraction)
    pool = train_split[cfg.probe_size:]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    half = cfg.batch_size // 2
    loss = torch.tensor(float("nan"))
    for step in range(1, cfg.steps + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.warmup_steps))
        problems = [rng.choice(pool) for _ in range(half)]
        ids, mask, labels = _batch(pairs(tokenizer, problems, rng, mistakes, cfg.policy_fraction))
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=cfg.lm_weight > 0)
        scores = out.logits[:, 0]
        loss = -F.logsigmoid(scores[:half] - scores[half:]).mean() \
            + cfg.bce_weight * F.binary_cross_entropy_with_logits(scores, labels)
        if cfg.lm_weight > 0:  # next-token loss on the correct answers' digits and eos, as the warm start's
            logits = lm_head(model.model.norm(out.hidden_states[backbone_layers][:half, :-1]))
            target = ids[:half, 1:].clone()
            target[mask[:half, 1:] == 0] = -100
            for row, p in enumerate(problems):  # the template renders the prompt first, one token a character
                target[row, :len(tokenizer.encode(p.prompt, add_special_tokens=False)) - 1] = -100
            loss = loss + cfg.lm_weight * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                          ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % cfg.report_every == 0 or step == cfg.steps:
            ranked, signed = agreement(model, probe)
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "probe_ranked": ranked,
                              "probe_sign_agreement": signed}), file=sys.stderr, flush=True)
    ranked, signed = agreement(model, probe)
    return {"steps": cfg.steps, "final_loss": round(loss.item(), 6), "probe_ranked": ranked,
            "probe_agreement": signed,
            "probe_sample_agreement": sample_agreement(model, tokenizer, task, train_split[:cfg.probe_size], samples)}


def save(model, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    save_char_tokenizer(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def prepare(policy_dir: str | Path, out_dir: str | Path, *, seed: int,
            cfg: RewardModelTraining = TRAINING) -> dict:
    began = time.monotonic()
    configure_determinism(seed, num_threads=cfg.num_threads)
    task = ArithmeticTask(ArithmeticConfig(**TASK_OPTIONS))
    tokenizer = build_char_tokenizer()
    policy = load_policy(policy_dir)
    samples = sampled_answers(policy, tokenizer, [p.prompt for p in task.split("train")], cfg,
                              torch.Generator().manual_seed(seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, lm_head, layers = build_from_policy(policy, cfg.extra_layers)
    lm_head.requires_grad_(False)
    report = train(model, lm_head, layers, tokenizer, task, cfg, seed=seed, samples=samples) if cfg.steps \
        else {"steps": 0}
    model.eval()
    out = save(model, out_dir)
    return {"model_dir": str(out.resolve()), "seed": seed, **report, "seconds": round(time.monotonic() - began, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="The warm-started policy directory (recipes.tiny_arith.prepare).")
    p.add_argument("--out", required=True, help="Directory to write the reward model into.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=TRAINING.steps, help="Optimizer steps (0: the untrained model).")
    p.add_argument("--threads", type=int, default=TRAINING.num_threads, help="torch intra-op threads.")
    args = p.parse_args(argv)
    import dataclasses

    cfg = dataclasses.replace(TRAINING, steps=args.steps, num_threads=args.threads)
    print(json.dumps(prepare(args.policy, args.out, seed=args.seed, cfg=cfg)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
