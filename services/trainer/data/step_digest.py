"""What a step was trained on, as one digest: a replayed TrainStep must carry the same trajectories.

A TrainStep for the step the trainer already applied is a replay (the
coordinator died between the update and its record). A replay that carries
trajectories is compared with the digest kept beside the step's metrics; a
different set is refused instead of answered with metrics it did not produce.
The digest is independent of arrival order (trajectories are hashed one by
one and the hashes sorted), since the order of a step's trajectories is not
part of what the step means; everything else about each one is.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import FailedPrecondition

_DOMAIN = b"lockstep.trajectories.v1"


def _field(h: "hashlib._Hash", data: bytes) -> None:
    h.update(struct.pack("<Q", len(data)))  # length-prefixed: no two field sequences hash alike
    h.update(data)


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype) -> bytes:
    return t.detach().to("cpu", dtype).contiguous().numpy().tobytes()


def sample_digest(sample: TrainSample) -> bytes:
    h = hashlib.sha256()
    _field(h, sample.sample_id.encode())
    _field(h, sample.group_id.encode())
    _field(h, _tensor_bytes(sample.prompt_ids, torch.int64))
    _field(h, _tensor_bytes(sample.response_ids, torch.int64))
    _field(h, _tensor_bytes(sample.rollout_logprobs, torch.float32))
    _field(h, struct.pack("<dd", sample.reward, sample.advantage))
    if sample.response_mask is not None:  # absent for single-turn samples, whose digests stay as they were
        _field(h, _tensor_bytes(sample.response_mask, torch.uint8))
    return h.digest()


def trajectories_digest(samples: Sequence[TrainSample]) -> str:
    """sha256 (hex) over every trajectory of a step, the same in any order."""
    h = hashlib.sha256(_DOMAIN)
    for d in sorted(sample_digest(s) for s in samples):
        h.update(d)
    return h.hexdigest()


def check_replay(step: int, recorded: str | None, samples: Sequence[TrainSample]) -> None:
    """Refuse a replay of `step` whose trajectories are not the ones the step was trained on.

    A replay without trajectories asks for the recorded metrics only (the
    restarted coordinator no longer has them) and is not compared."""
    if not samples:
        return
    if recorded is None:
        raise FailedPrecondition(
            f"step {step}: replayed with {len(samples)} trajectories, but no digest of the trajectories it was "
            "trained on is recorded (a checkpoint written before digests were kept); replay it without "
            "trajectories to get its recorded metrics"
        )
    digest = trajectories_digest(samples)
    if digest != recorded:
        raise FailedPrecondition(
            f"step {step}: replayed with trajectories other than the ones it was trained on "
            f"(digest {digest[:16]}, recorded {recorded[:16]}); nothing changed"
        )
