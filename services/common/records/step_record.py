"""One training step's input, on disk: what the coordinator sent the trainer, replayable alone.

A record holds the TrainStep stream exactly as it went over gRPC (header, then
every trajectory) plus what a trainer needs to be configured for it (run id,
model path, seed, trainer config). `python -m services.trainer.tools.replay` feeds it
to a fresh trainer: with the weights the step started from, it gives the
step's metrics and update bit for bit (same hardware, same thread count), so a
surprising step (an IW spike, a parity-gate refusal) can be studied without
the rollout side.

Layout: a magic line, one JSON line of metadata, then each TrainStepChunk as
an 8-byte little-endian length and its serialized bytes. Written to a
temporary file and renamed, so a record is whole or absent.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from proto import lockstep_pb2 as pb

MAGIC = b"LOCKSTEP-STEP-RECORD 1\n"
_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class StepRecordMeta:
    run_id: str
    step: int
    policy_version: int
    model_path: str
    seed: int
    trainer_config_json: str
    reward_scorers_json: str = ""
    """The scorer models that rewarded the step (model path, weights digest, template hash); "" for the rule."""


def write_step_record(path: Path, meta: StepRecordMeta, chunks: Iterable[pb.TrainStepChunk]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(json.dumps(meta.__dict__, sort_keys=True).encode() + b"\n")
        for chunk in chunks:
            data = chunk.SerializeToString(deterministic=True)
            f.write(_LEN.pack(len(data)))
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_step_record(path: Path) -> tuple[StepRecordMeta, list[pb.TrainStepChunk]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"record: no such file {str(path)!r}")
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"record: {path} is not a Lockstep step record (bad magic)")
    end = data.index(b"\n", len(MAGIC))
    try:
        meta = StepRecordMeta(**json.loads(data[len(MAGIC):end]))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"record: {path}: bad metadata line ({exc})") from None
    chunks, pos = [], end + 1
    while pos < len(data):
        if pos + _LEN.size > len(data):
            raise ValueError(f"record: {path}: truncated length at byte {pos}")
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise ValueError(f"record: {path}: chunk {len(chunks)} truncated ({n} bytes announced)")
        chunk = pb.TrainStepChunk()
        chunk.ParseFromString(data[pos:pos + n])
        chunks.append(chunk)
        pos += n
    return meta, chunks
