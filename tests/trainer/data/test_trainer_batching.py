"""Padded microbatches: next-token alignment, masks, token budget, deterministic order."""
from __future__ import annotations

import random

import pytest
import torch

from services.trainer.data.batching import (
    TrainSample,
    canonical_order,
    collate_padded,
    padded_microbatches,
    plan_padded,
)


def sample(sid: str, prompt: list[int], response: list[int], adv: float = 1.0) -> TrainSample:
    return TrainSample(
        sample_id=sid, group_id=sid.split("/")[0],
        prompt_ids=torch.tensor(prompt), response_ids=torch.tensor(response),
        rollout_logprobs=-torch.arange(1, len(response) + 1, dtype=torch.float32) / 10,
        reward=0.0, advantage=adv,
    )


def test_logits_at_t_score_token_t_plus_1():
    # Sequence 5 6 7 | 8 9: the model reads 5 6 7 8; position 2 (token 7) predicts 8,
    # position 3 (token 8) predicts 9. The last token (9) is never fed.
    mb = collate_padded([sample("g/0", [5, 6, 7], [8, 9], adv=0.5)])
    assert mb.input_ids.tolist() == [[5, 6, 7, 8]]
    assert mb.targets.tolist() == [[6, 7, 8, 9]]
    assert mb.loss_mask.tolist() == [[False, False, True, True]]
    assert mb.response_targets.tolist() == [8, 9]
    assert mb.response_rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2])
    assert mb.response_advantages.tolist() == [0.5, 0.5]


def test_single_token_prompt_and_response():
    mb = collate_padded([sample("g/0", [4], [7])])
    assert mb.input_ids.tolist() == [[4]] and mb.targets.tolist() == [[7]]
    assert mb.loss_mask.tolist() == [[True]]


def test_padding_is_masked_and_rows_keep_their_own_values():
    a = sample("a/0", [3, 4], [5, 6, 7], adv=2.0)   # L=5 -> 4 fed
    b = sample("b/0", [9], [10], adv=-1.0)           # L=2 -> 1 fed, 3 pad
    mb = collate_padded([a, b], pad_id=0)
    assert mb.input_ids.tolist() == [[3, 4, 5, 6], [9, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[False, True, True, True], [True, False, False, False]]
    # Row-major order of the masked positions: row a's 3 tokens, then row b's 1.
    assert mb.response_targets.tolist() == [5, 6, 7, 10]
    assert mb.response_advantages.tolist() == [2.0, 2.0, 2.0, -1.0]
    assert mb.response_rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.1])
    assert mb.rollout_logprobs[~mb.loss_mask].abs().sum() == 0
    assert mb.num_response_tokens == 4 and mb.num_padded_tokens == 8


def test_plan_respects_budget_and_isolates_oversized_rows():
    samples = canonical_order([
        sample("a/0", [1] * 10, [2] * 10),  # 19 fed tokens: above the budget alone
        sample("b/0", [1] * 3, [2] * 3),    # 5
        sample("c/0", [1] * 3, [2] * 2),    # 4
        sample("d/0", [1] * 2, [2] * 2),    # 3
        sample("e/0", [1], [2]),            # 1
    ])
    plan = plan_padded(samples, microbatch_tokens=10)
    assert [[s.sample_id for s in mb] for mb in plan] == [["a/0"], ["b/0", "c/0"], ["d/0", "e/0"]]
    for mb in plan[1:]:
        assert len(mb) * (max(s.num_tokens for s in mb) - 1) <= 10


def test_order_is_independent_of_arrival_order():
    samples = [sample(f"g{i % 3}/{i}", [1] * (1 + i % 4), [2] * (1 + i % 5)) for i in range(12)]
    reference = padded_microbatches(samples, 12)
    shuffled = list(samples)
    random.Random(7).shuffle(shuffled)
    again = padded_microbatches(shuffled, 12)
    assert [mb.sample_ids for mb in reference] == [mb.sample_ids for mb in again]
    for x, y in zip(reference, again):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
    # Every sample lands in exactly one microbatch.
    assert sorted(i for mb in reference for i in mb.sample_ids) == sorted(s.sample_id for s in samples)


def test_plan_refuses_bad_budget_and_collate_empty():
    with pytest.raises(ValueError, match="microbatch_tokens"):
        plan_padded([], 0)
    with pytest.raises(ValueError, match="empty"):
        collate_padded([])
