"""Checkpoints on a real full disk (a small tmpfs filled with a ballast file).

Each writer a checkpoint uses reports the full disk in its own form, and each is recognised as one; a
checkpoint that cannot be written leaves nothing behind (no target, no temporary sibling) and an older
checkpoint at the same path intact; once the ballast is gone the same call succeeds. A data-parallel
group whose rank 0 alone meets the full disk stays in step.
"""
from __future__ import annotations

import contextlib
import errno
import json

import pytest
import torch
from safetensors.torch import save_file

from services.trainer import checkpoint as ckpt
from services.trainer.disk_space import OutOfSpace, space_errno, writing
from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer
from services.trainer.trainer import Trainer
from tests.support.small_disk import fill, small_tmpfs

pytestmark = pytest.mark.usefixtures("restore_torch_globals")
DISK_BYTES = 4 << 20  # the tiny model's checkpoint is a few hundred kB
CONFIG = {"lr": 1e-2, "microbatch_tokens": 24}


@pytest.fixture
def disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", DISK_BYTES) as d:
        yield d


def _raised(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_every_writer_of_a_checkpoint_reports_a_full_disk_as_one(disk):
    tensors = {"w": torch.zeros(1 << 16)}
    f = open(disk / "optimizer.pt", "wb")  # opened first: on a full tmpfs even creating a file fails
    fill(disk)
    by_torch = _raised(lambda: torch.save(tensors, f))
    with contextlib.suppress(OSError):  # the buffer's rest cannot be flushed either
        f.close()
    by_safetensors = _raised(lambda: save_file(tensors, str(disk / "model.safetensors")))
    by_python = _raised(lambda: (disk / "state.json").write_text("x" * 8192))
    # torch and safetensors raise no OSError; what says "disk full" is in the context or the message.
    assert not isinstance(by_torch, OSError) and not isinstance(by_safetensors, OSError)
    assert [space_errno(e) for e in (by_torch, by_safetensors, by_python)] == [errno.ENOSPC] * 3
    assert space_errno(PermissionError(errno.EACCES, "denied")) is None
    assert space_errno(RuntimeError("unexpected pos 576 vs 534")) is None
    with pytest.raises(OutOfSpace, match=rf"directory: .*\(errno {errno.ENOSPC}\) writing {disk}/x"):
        with writing("directory", disk / "x"):
            save_file(tensors, str(disk / "x"))


def test_a_checkpoint_on_a_full_disk_writes_nothing_and_is_written_once_space_returns(tiny_model_dir, disk):
    t = Trainer(num_threads=1)
    t.configure(run_id="run", model_path=str(tiny_model_dir), seed=3, config_json=json.dumps(CONFIG))
    target = disk / "checkpoints" / "step_000001"
    ballast = fill(disk)
    refused = _raised(lambda: t.save_checkpoint("run", str(target)))
    assert space_errno(refused) == errno.ENOSPC, refused
    # Nothing that could pass for a checkpoint, and no temporary sibling holding the space.
    assert sorted(p.name for p in disk.rglob("*")) == ["ballast", "checkpoints"], sorted(disk.rglob("*"))
    ballast.unlink()
    path, version = t.save_checkpoint("run", str(target))
    assert path == target and version == 0 and ckpt.read_state(target).run_id == "run"
    written = {p.name: p.read_bytes() for p in target.iterdir()}

    # Re-saving over it on a full disk fails and leaves the checkpoint that was there whole.
    fill(disk)
    assert space_errno(_raised(lambda: t.save_checkpoint("run", str(target)))) == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in target.iterdir()} == written
    assert sorted(p.name for p in target.parent.iterdir()) == ["step_000001"]


def test_a_group_whose_rank_0_meets_a_full_disk_stays_in_step(tiny_model_dir, disk):
    group = GroupTrainer(GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=120))
    try:
        group.configure(run_id="run", model_path=str(tiny_model_dir), seed=3, config_json=json.dumps(CONFIG))
        ballast = fill(disk)
        refused = _raised(lambda: group.save_checkpoint("run", str(disk / "step_000000")))
        assert space_errno(refused) == errno.ENOSPC and not group.broken, (refused, group.broken)
        ballast.unlink()
        path, version = group.save_checkpoint("run", str(disk / "step_000000"))  # the group still answers
        assert version == 0 and ckpt.read_state(path).run_id == "run"
    finally:
        group.close()
