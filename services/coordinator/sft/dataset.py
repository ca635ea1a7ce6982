"""An SFT run's dataset: prompt/completion pairs or chat `messages`, from JSONL or Parquet, tokenized with the
loss mask on completion tokens only (docs/sft.md).

Parquet is read through Hugging Face `datasets` (`Dataset.from_parquet`, in memory, its cache in a temporary
directory); JSON Lines line by line with Python's json, so that each line keeps its own values and a bad one
is named (datasets' JSON loader types each column across the whole file). Everything is checked at submit,
where a bad file is refused naming the file, the line (JSONL) or row (Parquet) and the field: a line that is
not UTF-8 or not JSON, a missing or non-string field, a chat message with an unknown role, a conversation
without an assistant turn, a sequence longer than the limit.

Masks: a prompt/completion pair is prompt tokens then completion tokens (+ the end-of-sequence token), the
loss on the completion's. A conversation is rendered with the model's own chat template
(tokenizer_config.json's `chat_template`, Jinja in a sandbox, as transformers renders it); each assistant
turn's text is what rendering the conversation through that turn adds to rendering it up to the turn with
the generation prompt, and the tokens whose characters lie in those spans are the loss tokens: the prompt is
everything before the first one, and later user turns are in the response with a False mask (context, no
loss), as a multi-turn episode's observations are.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.common.models.directory import load_tokenizer

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
class SftExample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool] | None
    """Per response token: in the loss (True) or context (False, a later user turn); None = all in the loss."""


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(DATASETS_HINT) from exc
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _check_jsonl(path: Path) -> tuple[list[int], list[dict]]:
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
        lines, objects = _check_jsonl(path)
        if not lines:
            raise ValueError(f"{path} holds no examples")
        if len(objects) > MAX_SFT_EXAMPLES:
            raise ValueError(f"{path} holds more than {MAX_SFT_EXAMPLES} examples")
        # Each line's own values, from Python's json: datasets' JSON loader types a column across all lines,
        # so a "3" on one line can come back as 3 when another holds a number, and the line at fault could
        # not be named.
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


class ChatTemplate:
    """A model directory's chat template, rendered as transformers renders it (sandboxed Jinja)."""

    def __init__(self, model_dir: Path) -> None:
        config_file = model_dir / "tokenizer_config.json"
        template = None
        if config_file.is_file():
            template = json.loads(config_file.read_text()).get("chat_template")
        if not isinstance(template, str) or not template:
            raise ValueError(f"the model {model_dir} has no chat template (tokenizer_config.json's chat_template), "
                             "so chat messages cannot be rendered; use prompt/completion pairs")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template)

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


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


def _conversation(template: ChatTemplate, tokenizer, messages: list[dict], where: str) -> SftExample:
    full = template.render(messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[:i + 1], add_generation_prompt=False)
        if not through.startswith(before) or not full.startswith(through):
            raise ValueError(f"{where}: the model's chat template does not render this conversation turn by turn "
                             f"(turn {i} changes what came before it), so its assistant tokens cannot be found")
        spans.append((len(before), len(through)))
    encoding = tokenizer.encode(full, add_special_tokens=False)
    in_loss = [any(a <= start < b for a, b in spans) for start, _end in encoding.offsets]
    if not any(in_loss):
        raise ValueError(f"{where}: no token of an assistant turn")
    first = in_loss.index(True)
    if first == 0:
        raise ValueError(f"{where}: the conversation renders no prompt before its first assistant turn")
    ids = list(encoding.ids)
    mask = in_loss[first:]
    return SftExample(ids[:first], ids[first:], None if all(mask) else mask)


def read_sft_dataset(spec: SftSpec, model_dir: str | Path) -> list[SftExample]:
    """Every example of the dataset, tokenized with the model's tokenizer; ValueError naming the file, the
    line or row, and the field of the first bad one."""
    from tokenizers import Tokenizer

    path, model_dir = Path(spec.path), Path(model_dir)
    rows, where = _rows(path)
    eos = load_tokenizer(model_dir).eos_token_id
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chat = spec.messages_field in rows[0]
    template = ChatTemplate(model_dir) if chat else None
    out = []
    for row, at in zip(rows, where):
        at = f"{path} {at}"
        if template is not None:
            example = _conversation(template, tokenizer, _messages(row, spec.messages_field, at), at)
        else:
            prompt = tokenizer.encode(_text(row, spec.prompt_field, at), add_special_tokens=False).ids
            completion = tokenizer.encode(_text(row, spec.completion_field, at), add_special_tokens=False).ids
            if not prompt:
                raise ValueError(f"{at}: field {spec.prompt_field!r} is empty (a prompt of at least one token "
                                 "is needed)")
            completion = completion + ([eos] if eos is not None else [])
            if not completion:
                raise ValueError(f"{at}: field {spec.completion_field!r} is empty")
            example = SftExample(prompt, completion, None)
        length = len(example.prompt_ids) + len(example.response_ids)
        if length > spec.max_sequence_tokens:
            raise ValueError(f"{at}: {length} tokens, more than sft.max_sequence_tokens {spec.max_sequence_tokens}")
        out.append(example)
    return out
