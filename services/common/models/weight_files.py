"""The weight files of a Hugging Face model directory: which ones from_pretrained reads, and which of them
does not load.

`from_pretrained` reads model.safetensors (or the shards model.safetensors.index.json names) when the
directory has them, else pytorch_model.bin (or its index's shards); pickled .bin files go through
torch.load(weights_only=True), which refuses any pickle that names a global outside torch's allow-list
(so a file whose unpickling would run code is refused, not run). What it raises then names neither the
file nor the directory: `diagnose` re-checks the files, with the same safe readers, to say which file it
was and why, so a request that named the directory can be refused naming the file.
"""
from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

SAFETENSORS_SINGLE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE_SINGLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
MAX_REASON_CHARS = 400


class WeightFileError(ValueError):
    """A weight file of a model directory that is not loadable; the message names the file."""


def weight_files(directory: Path) -> list[Path]:
    """The files from_pretrained reads the weights from, in its order of preference (safetensors first).
    WeightFileError for an index that is unreadable or names a shard outside the directory (a path
    with a separator or '..' could make a loader read a file outside the directory's root)."""
    for single, index in ((SAFETENSORS_SINGLE, SAFETENSORS_INDEX), (PICKLE_SINGLE, PICKLE_INDEX)):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            return [directory / name for name in _shard_names(directory / index)]
    return []


def _shard_names(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightFileError(f"{index}: not a weight index ({type(exc).__name__}: {exc})") from None
    for name in names:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise WeightFileError(f"{index}: weight_map names {name!r}, not a file of the directory")
    return names


def check_weight_files(directory: Path) -> None:
    """Refuse a directory whose index names a shard outside it, before any loader follows that index."""
    weight_files(directory)


def diagnose(directory: Path) -> WeightFileError | None:
    """The first weight file of `directory` that does not load (safetensors' header and every tensor's
    slice; a pickle with torch.load(weights_only=True), memory-mapped when it is a zip), as an error
    naming it; None when every one loads (the failure was not the files')."""
    try:
        files = weight_files(directory)
    except WeightFileError as exc:
        return exc
    for path in files:
        if not path.is_file():
            return WeightFileError(f"{path}: missing (named by the directory's weight index)")
        try:
            _check_safetensors(path) if path.suffix == ".safetensors" else _check_pickle(path)
        except Exception as exc:  # noqa: BLE001 - whatever a reader raises is the file's fault here
            return load_failure(path, exc)
    return None


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            f.get_slice(key).get_shape()


def _check_pickle(path: Path) -> None:
    import torch

    torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))


def load_failure(path: Path, exc: BaseException) -> WeightFileError:
    """`exc`, which reading weight file `path` raised, as an error naming the file (and, for a pickle
    torch.load refused, the refusal's cause alone)."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError):
        text = ("refused by torch.load(weights_only=True), the only way pickled weights are read: "
                f"{_unpickler_cause(text)}")
    else:
        text = f"{type(exc).__name__}: {text}"
    return WeightFileError(f"{path}: " + (text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."))


def _unpickler_cause(text: str) -> str:
    """The cause in torch's refusal (e.g. 'Unsupported global: GLOBAL io.open was not an allowed global by
    default'), without the page of advice around it on how to allowlist the global or load unsafely."""
    _, marker, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if marker else text).splitlines() if line.strip()]
    return lines[0].split(". Please ")[0] if lines else "the file is not a weights-only pickle"
