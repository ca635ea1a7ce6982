"""An SFT run's dataset as rows: the run spec's `sft` section, and the reading and field checks every example
passes before it is tokenized (docs/sft.md).

Pydantic and the standard library (Parquet through Hugging Face `datasets`, imported when a Parquet file is
read): the coordinator's reader (services/coordinator/sft/dataset.py) tokenizes what `read_sft_rows` returns,
and `lockstep recipe prepare` runs the same function on a recipe's dataset before anything is submitted, so
both refuse the same lines with the same words. JSON Lines are read line by line with Python's json, so each
line keeps its own values and a bad one is named (datasets' JSON loader types each column across the whole
file, which would hide the line at fault).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

MAX_SFT_BYTES = 1 << 30
"""Largest dataset file an SFT run may name."""
MAX_SFT_EXAMPLES = 1_000_000
"""Most examples an SFT dataset may hold."""
ROLES = ("system", "user", "assistant")
"""Chat roles a message may have; the loss covers the assistant's."""
DATASETS_HINT = "Hugging Face datasets is not installed: pip install 'datasets==5.2.0' (pinned in requirements.lock)"


class SftSpec(BaseModel):
    """The run spec's `sft` section (kind: sft)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., min_length=1, max_length=4096, description="Local dataset file inside the coordinator's "
                      "data roots: JSON Lines (.jsonl, .json) or Parquet (.parquet), one example per line or row.")
    prompt_field: str = Field("prompt", min_length=1, max_length=128, description="Field of the prompt text "
                              "(prompt/completion pairs).")
    completion_field: str = Field("completion", min_length=1, max_length=128, description="Field of the "
                                  "completion text; the loss covers its tokens and the end-of-sequence token.")
    messages_field: str = Field("messages", min_length=1, max_length=128, description="Field of a chat "
                                "conversation ([{role, content}], roles system/user/assistant); when the file "
                                "has it, every example is a conversation and the loss covers the assistant turns, "
                                "as the model's chat template renders them.")
    batch_size: int = Field(32, ge=1, le=65536, description="Examples per optimizer step, drawn in a seeded "
                            "shuffle of the dataset, epoch after epoch.")
    max_sequence_tokens: int = Field(4096, ge=2, le=1 << 20, description="Longest example (prompt + completion "
                                     "tokens); a longer one is refused at submit, naming its line.")


@dataclass(frozen=True)
class SftRow:
    """One example whose fields passed the checks, not yet tokenized."""

    where: str
    """'<file> line N' (JSON Lines) or '<file> row N' (Parquet), for the messages of later checks."""
    messages: list[dict] | None
    """The conversation ({role, content} strings), or None for a prompt/completion pair."""
    prompt: str = ""
    completion: str = ""


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(DATASETS_HINT) from exc
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _jsonl_objects(path: Path) -> tuple[list[int], list[dict]]:
    """The 1-based line numbers of the file's non-blank lines and their objects; ValueError naming the first
    line that is not UTF-8 or not one JSON object."""
    numbers, objects = [], []
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path} line {n}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {n}: not JSON ({exc.msg})") from None
            if not isinstance(value, dict):
                raise ValueError(f"{path} line {n}: not a JSON object")
            numbers.append(n)
            objects.append(value)
    return numbers, objects


def _rows(path: Path) -> tuple[list[dict], list[str]]:
    """(rows, where each row is: 'line N' or 'row N')."""
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    if path.stat().st_size > MAX_SFT_BYTES:
        raise ValueError(f"{path} is larger than {MAX_SFT_BYTES} bytes")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        lines, objects = _jsonl_objects(path)
        if not lines:
            raise ValueError(f"{path} holds no examples")
        if len(objects) > MAX_SFT_EXAMPLES:
            raise ValueError(f"{path} holds more than {MAX_SFT_EXAMPLES} examples")
        return objects, [f"line {n}" for n in lines]
    if suffix != ".parquet":
        raise ValueError(f"{path}: {suffix or 'no extension'} is neither JSON Lines (.jsonl) nor Parquet (.parquet)")
    datasets = _datasets()
    with tempfile.TemporaryDirectory(prefix="lockstep-sft-") as cache:
        try:
            table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True, cache_dir=cache)
        except Exception as exc:  # pyarrow's own errors for a file that is not Parquet
            raise ValueError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    if len(table) > MAX_SFT_EXAMPLES:
        raise ValueError(f"{path} holds more than {MAX_SFT_EXAMPLES} examples")
    if len(table) == 0:
        raise ValueError(f"{path} holds no examples")
    return table.to_list(), [f"row {i + 1}" for i in range(len(table))]


def _text(row: dict, field: str, where: str) -> str:
    value = row.get(field)
    if value is None:
        raise ValueError(f"{where}: field {field!r} missing")
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
    return value


def _messages(row: dict, field: str, where: str) -> list[dict]:
    value = row.get(field)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field {field!r} missing or not a list of messages")
    out = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {field}[{j}] is not an object")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: {field}[{j}].role: unknown role {role!r} (known: {', '.join(ROLES)})")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {field}[{j}].content missing or not a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError(f"{where}: {field} has no assistant message, so nothing to train on")
    return out


def read_sft_rows(spec: SftSpec) -> list[SftRow]:
    """Every example of `spec.path` with its fields checked; ValueError naming the file, the line or row and
    the field of the first bad one. When the first example has `messages_field`, every example is a
    conversation; otherwise every example is a prompt/completion pair."""
    path = Path(spec.path)
    rows, where = _rows(path)
    chat = spec.messages_field in rows[0]
    out = []
    for row, at in zip(rows, where):
        at = f"{path} {at}"
        if chat:
            out.append(SftRow(at, _messages(row, spec.messages_field, at)))
        else:
            out.append(SftRow(at, None, _text(row, spec.prompt_field, at), _text(row, spec.completion_field, at)))
    return out
