"""The rows of a task's data file, whatever its format: JSONL, Parquet, or a saved Hugging Face dataset.

Each reader yields (row number from 1, the row as a dict) and names the file and row in every refusal.
pyarrow and datasets are imported only for a file of their format, with the install hint when missing.
Limits as for JSONL (contract/data/math_options.py): the file's bytes (a directory's total) and its rows.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from contract.data.math_options import MAX_DATASET_BYTES, MAX_DATASET_LINES
from contract.data.prompt_dataset import PromptDataset

HINTS = {"pyarrow": "pip install 'pyarrow==26.0.1' (pinned in requirements.lock)",
         "datasets": "pip install 'datasets==5.2.0' (pinned in requirements.lock)"}


def data_format(path: Path, dataset: PromptDataset) -> str:
    if dataset.format != "auto":
        return dataset.format
    if path.is_dir():
        return "hf_disk"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def row_word(fmt: str) -> str:
    """What a refusal calls one problem of the format: a JSONL file has lines."""
    return "line" if fmt == "jsonl" else "row"


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _require(module: str, field_prefix: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(f"{field_prefix}: reading this format needs {module}: {HINTS[module]}") from None


def read_rows(path_text: str, field_prefix: str, dataset: PromptDataset) -> Iterator[tuple[int, object]]:
    """(row number, row) of every problem of the file; ValueError starting with `field_prefix` otherwise. A
    JSONL line that is not JSON is refused here; a row that is not an object is the caller's to refuse."""
    path = Path(path_text)
    try:
        fmt = data_format(path, dataset)
        if fmt == "hf_disk" and not path.is_dir():
            raise ValueError(f"{field_prefix}: {path_text!r} is not a directory (format hf_disk)")
        if fmt != "hf_disk" and not path.is_file():
            raise ValueError(f"{field_prefix}: no such file {path_text!r}")
        size = _size(path)
    except OSError as exc:
        raise ValueError(f"{field_prefix}: cannot read {path_text!r} ({exc.strerror})") from None
    if size > MAX_DATASET_BYTES:
        raise ValueError(f"{field_prefix}: {path_text} has {size} bytes, more than the {MAX_DATASET_BYTES} allowed")
    if fmt == "jsonl":
        yield from _jsonl_rows(path, path_text, field_prefix)
        return
    rows = _parquet_rows(path, field_prefix) if fmt == "parquet" else _hf_rows(path, field_prefix, dataset.split)
    for n, row in enumerate(rows, start=1):
        if n > MAX_DATASET_LINES:
            raise ValueError(f"{field_prefix}: {path_text} has more than {MAX_DATASET_LINES} rows")
        yield n, row


def _jsonl_rows(path: Path, path_text: str, field_prefix: str) -> Iterator[tuple[int, object]]:
    try:
        with path.open(encoding="utf-8", errors="strict") as f:
            for n, line in enumerate(f, start=1):
                if n > MAX_DATASET_LINES:
                    raise ValueError(f"{field_prefix}: {path_text} has more than {MAX_DATASET_LINES} lines")
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{field_prefix}: line {n} is not JSON ({exc.msg})") from None
                except RecursionError:
                    raise ValueError(f"{field_prefix}: line {n} is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{field_prefix}: {path_text} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{field_prefix}: cannot read {path_text!r} ({exc.strerror})") from None


def _parquet_rows(path: Path, field_prefix: str) -> list[dict]:
    _require("pyarrow", field_prefix)
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
        if metadata.num_rows > MAX_DATASET_LINES:
            raise ValueError(f"{field_prefix}: {path} has {metadata.num_rows} rows, more than {MAX_DATASET_LINES}")
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        if str(exc).startswith(field_prefix):
            raise
        raise ValueError(f"{field_prefix}: {path} is not a readable Parquet file ({exc})") from None


def _hf_rows(path: Path, field_prefix: str, split: str):
    datasets = _require("datasets", field_prefix)
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise ValueError(f"{field_prefix}: {path} is not a saved Hugging Face dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{field_prefix}: {path} has no split {split!r} (dataset.split; it has "
                             f"{sorted(loaded)})")
        loaded = loaded[split]
    if loaded.num_rows > MAX_DATASET_LINES:
        raise ValueError(f"{field_prefix}: {path} has {loaded.num_rows} rows, more than {MAX_DATASET_LINES}")
    return loaded.to_list()
