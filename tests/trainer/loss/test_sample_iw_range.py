"""Each sample's IW range: the per-token weights of the step's mismatch_stats, reduced per sample."""
from __future__ import annotations

import math

import torch

from services.trainer.loss.surrogate import mismatch_stats, sample_iw_range


def test_each_samples_range_is_its_tokens_and_their_extremes_are_the_steps():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(40, generator=gen, dtype=torch.float32) * 3
    rollout = logp + (torch.rand(40, generator=gen) - 0.5) * 0.2
    index = torch.randint(0, 5, (40,), generator=gen)
    index[:5] = torch.arange(5)  # every sample but the last (6) has tokens
    low, high = sample_iw_range(logp, rollout, index, 6)
    iw = torch.exp(logp.double() - rollout.double())  # the weights mismatch_stats reduces, token by token
    for i in range(5):
        mine = iw[index == i].tolist()
        assert (low[i].item(), high[i].item()) == (min(mine), max(mine))
    assert math.isnan(low[5].item()) and math.isnan(high[5].item())
    stats = mismatch_stats(logp, rollout)
    assert (low[:5].min().item(), high[:5].max().item()) == (stats.iw_min, stats.iw_max)
