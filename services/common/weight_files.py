"""Shared-path weight source: the trainer writes one policy version as a safetensors directory, a replica
on a host that sees the same path reads it back.

The directory is a complete model directory: the run's model's other files (config, tokenizer) copied
beside `model.safetensors`, so an engine that loads model directories itself (SGLang's
/update_weights_from_disk) loads it in place. The weight file's metadata records the policy version and the order the
tensors stream in. Its digest is services.common.weight_digest's over the tensors in that order: exactly
the total_sha256 of the GetWeights stream of the same weights (both are defined over each tensor's bytes
in fixed blocks, however the stream is chunked), so a replica reports one digest per version whichever
source it read. The writer computes the digest over what it wrote, the reader over what it read (the
file is memory-mapped by safetensors' safe_open; each tensor is copied out once and hashed once, its
blocks on several threads); a reader whose digest, version or layout disagrees applies nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.weight_digest import tensors_digest

WEIGHTS_FILE = "model.safetensors"
# The base model's files that are weights (or their index) and are therefore not copied.
BASE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
BASE_WEIGHT_INDEX = "model.safetensors.index.json"
VERSION_KEY = "lockstep.policy_version"
ORDER_KEY = "lockstep.tensor_order"


class WeightFilesError(ValueError):
    """A weight directory that is missing, malformed, of another version or fails its digest."""


@dataclass(frozen=True)
class WeightFiles:
    directory: Path
    policy_version: int
    tensors: int
    nbytes: int
    total_sha256: str


@contextlib.contextmanager
def staged_model_dir(final: Path, base_dir: str | Path) -> Iterator[Path]:
    """A staging directory beside `final`, holding base_dir's files other than weights (config, tokenizer,
    generation config); the block writes the weights into it. Renamed to `final` when the block ends and
    removed if it raises, so a reader never sees a half-written model directory. `final` must not exist."""
    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for f in Path(base_dir).iterdir():
            if f.is_file() and not f.name.endswith(BASE_WEIGHT_SUFFIXES) and f.name != BASE_WEIGHT_INDEX:
                shutil.copy2(f, staging / f.name)
        yield staging
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_weight_dir(directory: str | Path, named_tensors: list[tuple[str, torch.Tensor]],
                     policy_version: int, base_dir: str | Path) -> WeightFiles:
    """Write the tensors (stream order) and base_dir's non-weight files as `directory`; it must not exist.
    Written beside it and renamed into place, so a reader never sees a half-written directory."""
    final = Path(directory)
    if final.exists():
        raise WeightFilesError(f"directory: {str(final)!r} already exists (one directory per version)")
    names = [n for n, _ in named_tensors]
    if not names or len(set(names)) != len(names):
        raise WeightFilesError("tensors: need at least one, each name once")
    tensors = {n: t.detach().contiguous().cpu() for n, t in named_tensors}
    with staged_model_dir(final, base_dir) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE),
                  metadata={VERSION_KEY: str(int(policy_version)), ORDER_KEY: json.dumps(names)})
    digest, nbytes = tensors_digest([(n, tensors[n]) for n in names])
    return WeightFiles(final, int(policy_version), len(names), nbytes, digest)


def read_weight_dir(directory: str | Path, *, policy_version: int,
                    expected_sha256: str) -> tuple[dict[str, torch.Tensor], WeightFiles]:
    """The directory's tensors, after its version and its digest (recomputed here) match the expected."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise WeightFilesError(f"directory: no {WEIGHTS_FILE} in {str(directory)!r}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        try:
            version = int(meta[VERSION_KEY])
            order = json.loads(meta[ORDER_KEY])
        except (KeyError, ValueError) as exc:
            raise WeightFilesError(f"directory: {str(directory)!r} is not a WriteWeights directory "
                                   f"(metadata {exc})") from None
        if version != policy_version:
            raise WeightFilesError(f"policy_version: the directory holds version {version}, not {policy_version}")
        if not isinstance(order, list) or sorted(order) != sorted(f.keys()):
            raise WeightFilesError("directory: the recorded tensor order does not name the file's tensors")
        tensors = {name: f.get_tensor(name) for name in order}
    digest, nbytes = tensors_digest([(n, tensors[n]) for n in order])
    if digest != expected_sha256:
        raise WeightFilesError(f"expected_sha256: the directory's tensors hash to {digest}, "
                               f"not {expected_sha256}")
    return tensors, WeightFiles(Path(directory), version, len(order), nbytes, digest)
