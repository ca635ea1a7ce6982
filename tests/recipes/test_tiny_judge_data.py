"""The tiny_judge reward model's training data: the wrong answers it learns from are wrong by the task's rule,
cover every way of being wrong, and half come from the policy's own samples, drawn deterministically."""
from __future__ import annotations

import dataclasses
import random

import torch

from recipes.char_tokenizer import build_char_tokenizer
from recipes.tiny_arith import TASK_OPTIONS
from recipes.tiny_judge import TRAINING
from recipes.tiny_judge.reward_model import edited_answer, load_policy, pairs, policy_mistakes, sampled_answers
from recipes.tiny_model import build_model_dir
from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

TASK = ArithmeticTask(ArithmeticConfig(**TASK_OPTIONS))


def test_an_edited_answer_is_always_wrong_and_every_position_and_length_change_occurs():
    rng = random.Random(0)
    changed_positions, lengths = set(), set()
    for answer in ("7", "42", "99", "108", "198"):
        for _ in range(400):
            wrong = edited_answer(answer, rng)
            assert wrong != answer and wrong.isdigit(), (answer, wrong)
            if len(wrong) == len(answer):
                diff = [i for i, (a, b) in enumerate(zip(answer, wrong)) if a != b]
                assert len(diff) == 1, (answer, wrong)  # one digit changed, never two
                changed_positions.add((len(answer), diff[0]))
            else:
                lengths.add(len(wrong) - len(answer))
    assert changed_positions == {(n, i) for n in (1, 2, 3) for i in range(n)}
    assert lengths == {-2, -1, 1}  # "108" -> "8" is two shorter; "7" -> "7d" one longer


def test_the_policys_samples_are_drawn_per_prompt_deterministically_and_labelled_by_the_rule(tmp_path):
    policy = load_policy(build_model_dir(tmp_path / "policy", seed=0))
    tokenizer = build_char_tokenizer()
    problems = list(TASK.split("train"))[:12]
    cfg = dataclasses.replace(TRAINING, policy_samples=3, sample_batch_prompts=5)
    prompts = [p.prompt for p in problems]
    first = sampled_answers(policy, tokenizer, prompts, cfg, torch.Generator().manual_seed(7))
    again = sampled_answers(policy, tokenizer, prompts, cfg, torch.Generator().manual_seed(7))
    other = sampled_answers(policy, tokenizer, prompts, cfg, torch.Generator().manual_seed(8))
    assert first == again and first != other
    assert list(first) == list(dict.fromkeys(prompts)) and all(len(v) == 3 for v in first.values())
    assert all(len(tokenizer.encode(a, add_special_tokens=False)) <= cfg.sample_max_new_tokens
               for answers in first.values() for a in answers)

    # An untrained policy writes no right sums; give one prompt its right answer to see it filtered out.
    first[problems[0].prompt].append(problems[0].answer)
    mistakes = policy_mistakes(first, TASK, problems)
    assert problems[0].answer not in mistakes[problems[0].prompt]
    assert all(TASK.reward(p, a) == 0.0 for p in problems for a in mistakes[p.prompt])
    assert sum(map(len, mistakes.values())) == 12 * 3


def test_pairs_draw_the_policys_own_mistakes_at_the_configured_fraction():
    tokenizer = build_char_tokenizer()
    problems = list(TASK.split("train"))[:200]
    own = {p.prompt: [p.answer + "5"] for p in problems}  # a mistake edited_answer may also write
    rendered_own = {tuple(pairs(tokenizer, [p], random.Random(0), own, 1.0)[1][0]) for p in problems}
    for fraction in (0.0, 0.5, 1.0):
        batch = pairs(tokenizer, problems, random.Random(1), own, fraction)
        right, wrong = batch[:200], batch[200:]
        assert all(label == 1.0 for _, label in right) and all(label == 0.0 for _, label in wrong)
        share = sum(tuple(ids) in rendered_own for ids, _ in wrong) / len(wrong)
        if fraction == 1.0:
            assert share == 1.0
        elif fraction == 0.0:
            assert share < 0.25  # only edited answers that happen to append a 5
        else:
            assert 0.4 < share < 0.75
    # A problem the policy made no mistake on always gets an edited answer.
    assert pairs(tokenizer, problems[:1], random.Random(2), {}, 1.0)[1][1] == 0.0


def test_the_replicas_step_raises_the_logprob_of_what_it_rewards(tmp_path):
    from recipes.tiny_judge.replica import policy_gradient_step, sample_step

    torch.manual_seed(0)
    policy = load_policy(build_model_dir(tmp_path / "policy", seed=0))
    tokenizer = build_char_tokenizer()
    rollouts = sample_step(policy, tokenizer, list(TASK.split("train"))[:2])
    assert len(rollouts) == 16 and [r[0] for r in rollouts[:8]] == [rollouts[0][0]] * 8

    def logprob(row) -> float:
        _, prompt, response = rollouts[row]
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
        return float(logits.gather(1, torch.tensor(response)[:, None]).sum())

    other = next(row for row in range(1, 16) if rollouts[row][2] != rollouts[0][2])  # an untrained policy varies
    before = logprob(0), logprob(other)
    advantages = [0.0] * 16
    advantages[0], advantages[other] = 1.0, -1.0
    policy_gradient_step(policy, torch.optim.SGD(policy.parameters(), lr=0.5), rollouts, advantages)
    assert logprob(0) > before[0] and logprob(other) < before[1]
