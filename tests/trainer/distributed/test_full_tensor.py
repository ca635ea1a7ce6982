"""full_tensor of a parameter sharded over a world of one: the whole tensor, as a new tensor (the shortcut
that skips the per-tensor gather must not hand out the live parameter)."""
from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from services.trainer.distributed import sharding


def test_a_world_of_one_gives_a_copy_of_the_whole_tensor():
    sharding.ensure_single_process_group(torch.device("cpu"))
    layer = torch.nn.Linear(6, 5)
    expected = {name: p.detach().clone() for name, p in layer.named_parameters()}
    fully_shard(layer)
    for name, p in layer.named_parameters():
        whole = sharding.full_tensor(p.detach())
        assert type(whole) is torch.Tensor and whole.equal(expected[name])
        whole.add_(1.0)  # a copy: the parameter is unchanged
        assert sharding.full_tensor(p.detach()).equal(expected[name])
