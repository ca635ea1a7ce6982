"""SFT's loss on the trainer's real path: completion tokens only, whatever the prompt holds.

Examples come from the coordinator's SFT reader shape (prompt ids, response ids, a mask for later user
turns), packed by the trainer's own microbatching and scored by its policy: the loss tokens are exactly the
completion's (a conversation's user turns inside the response are context), every loss token's gradient
d loss / d logp is -1/N however the prompt tokens change (other ids, another length), and one SFT step
lowers the completions' negative log-likelihood.
"""
from __future__ import annotations

import json

import pytest
import torch

from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.trainer.data.batching import TrainSample, canonical_order
from services.trainer.data.wire import StepRequest
from services.trainer.loss.policy_loss import step_shape
from services.trainer.loss.supervised import sft_microbatch_loss
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")
SMALL = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("sft") / "m", SMALL, seed=2)


def trainer(model_dir, run_id="sft") -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id=run_id, model_path=str(model_dir), seed=1, config_json=json.dumps(
        {"objective": "sft", "lr": 1e-2, "microbatch_tokens": 40}))
    return t


def sample(i: int, prompt: list[int], response: list[int], mask: list[bool] | None = None) -> TrainSample:
    return TrainSample(f"e{i}", f"e{i}", torch.tensor(prompt), torch.tensor(response), torch.zeros(
        sum(mask) if mask else len(response)), 0.0, 0.0, None if mask is None else torch.tensor(mask))


# Completion tokens are ids >= 50; a conversation's second user turn (ids 20-22) sits inside the response.
COMPLETIONS = [([50, 51, 2], None), ([60, 61, 20, 21, 22, 62, 2], [True, True, False, False, False, True, True]),
               ([70, 2], None)]


def batch(prompts: list[list[int]]) -> list[TrainSample]:
    return [sample(i, p, r, m) for i, (p, (r, m)) in enumerate(zip(prompts, COMPLETIONS))]


def loss_gradients(t: Trainer, samples: list[TrainSample]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Per sample: its loss tokens' targets and d loss / d logp of each, through the trainer's packing and policy."""
    run = t.run
    shape = step_shape(canonical_order(samples))
    ids = [s.sample_id for s in canonical_order(samples)]
    out = {}
    for mb in t._microbatches(run, samples):
        logp = run.policy(mb, temperature=1.0)[0]
        logp.retain_grad()
        sft_microbatch_loss(run.config, logp, mb.response_sample_index, shape).loss.backward()
        for index in mb.response_sample_index.unique().tolist():
            rows = mb.response_sample_index == index
            out[ids[index]] = (mb.response_targets[rows].tolist(), logp.grad[rows].clone())
    return out


def test_the_loss_covers_completion_tokens_only_and_prompts_do_not_change_their_gradients(model_dir):
    t = trainer(model_dir)
    first = loss_gradients(t, batch([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
    other = loss_gradients(t, batch([[30, 31, 32, 33, 34], [40], [41, 42]]))  # other ids, other lengths
    n = sum(sum(m) if m else len(r) for r, m in COMPLETIONS)
    for i, (response, mask) in enumerate(COMPLETIONS):
        want = [tok for k, tok in enumerate(response) if mask is None or mask[k]]
        targets, grad = first[f"e{i}"]
        assert targets == want  # no prompt token, no user-turn token
        assert torch.equal(grad, torch.full_like(grad, -1.0 / n))
        assert other[f"e{i}"][0] == targets and torch.equal(other[f"e{i}"][1], grad)


def test_an_sft_step_lowers_the_completions_loss(model_dir):
    t = trainer(model_dir, "sft-step")
    samples = batch([[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    losses = [t.train_step(StepRequest("sft-step", s, s - 1, samples)).metrics["loss"] for s in (1, 2, 3)]
    assert losses[2] < losses[1] < losses[0], losses
