"""Synced checkpoints for SGLang's /update_weights_from_disk.

The engine receives the trainer's tensors (Engine.update_weights) and writes
them as an ordinary Hugging Face directory: the base model's non-weight files
(config, generation config, tokenizer) plus safetensors shards. The directory
is written under a temporary name and renamed into place, so a server (or a
restarted server) never sees half a checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from services.common.weights.files import BASE_WEIGHT_INDEX, staged_model_dir
from services.common.weights.finite_check import all_finite

SHARD_BYTES = 4 * 2**30  # per file; safetensors loads shards independently


def checkpoint_specs(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in a safetensors checkpoint, read from headers only."""
    from safetensors import safe_open

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path: {d} has no *.safetensors (SGLang sync writes and reads safetensors)")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                specs[name] = (tuple(sl.get_shape()), _DTYPES[sl.get_dtype()])
    return specs


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def tied_embeddings(model_dir: str | Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(cfg.get("tie_word_embeddings", False))


def eos_token_ids(model_dir: str | Path) -> set[int]:
    """Every eos id SGLang stops on by itself (config.json and generation_config.json)."""
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = Path(model_dir) / name
        if not p.is_file():
            continue
        eos = json.loads(p.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            out.add(eos)
        elif isinstance(eos, list):
            out.update(int(e) for e in eos)
    return out


def verify_tensors(
    tensors: dict[str, torch.Tensor],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *, tied: bool,
) -> dict[str, torch.Tensor]:
    """All checks before anything is written; returns the tensors to save.

    Every checkpoint tensor must be sent (one left out would keep the old
    policy under the new version number); unknown names and shape changes are
    refused. With tied embeddings an lm_head.weight the checkpoint doesn't
    store is accepted and dropped (it is the embedding).
    """
    sent = dict(tensors)
    if tied and "lm_head.weight" in sent and "lm_head.weight" not in specs:
        sent.pop("lm_head.weight")
    missing = sorted(set(specs) - set(sent))
    unknown = sorted(set(sent) - set(specs))
    if missing or unknown:
        raise ValueError(
            f"tensors: do not match the checkpoint (missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''})"
        )
    for name, t in sent.items():
        shape, _ = specs[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensors[{name!r}]: shape {tuple(t.shape)} != checkpoint {shape}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"tensors[{name!r}]: dtype {t.dtype} is not floating point")
        if not all_finite(t):
            raise ValueError(f"tensors[{name!r}]: contains NaN or Inf")
    return sent


def verify_broadcast_plan(
    announced: list[tuple[str, str, tuple[int, ...]]],
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    *, tied: bool,
) -> None:
    """verify_tensors' checks on what a broadcast announces (name, dtype name, shape), before a byte moves:
    the whole checkpoint, nothing unknown, the checkpoint's shapes, floating-point dtypes. The values arrive
    in the server, out of this process's reach."""
    names = {name for name, _, _ in announced}
    if tied and "lm_head.weight" not in specs:
        names.discard("lm_head.weight")
    missing, unknown = sorted(set(specs) - names), sorted(names - set(specs))
    if missing or unknown:
        raise ValueError(
            f"plan: does not match the checkpoint (missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''})")
    for name, dtype, shape in announced:
        if name not in specs:
            continue  # a tied lm_head the checkpoint does not store
        if tuple(shape) != specs[name][0]:
            raise ValueError(f"plan: {name!r} has shape {tuple(shape)}, the checkpoint {specs[name][0]}")
        if dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ValueError(f"plan: {name!r} has dtype {dtype}, not floating point")


def write_checkpoint(tensors: dict[str, torch.Tensor], base_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `tensors` + base_dir's non-weight files as `out_dir`, atomically (tmp dir + rename)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"weights_dir: {out} already exists")
    with staged_model_dir(out, base_dir) as tmp:
        shards = _shard(tensors)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / BASE_WEIGHT_INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return out


def _shard(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def load_checkpoint_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
