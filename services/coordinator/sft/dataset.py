"""An SFT run's dataset: prompt/completion pairs or chat `messages`, from JSONL or Parquet, tokenized with the
loss mask on completion tokens only (docs/sft.md).

The file is read and its fields checked by contract/data/sft_dataset.py (Parquet through Hugging Face
`datasets`, JSON Lines line by line), which `lockstep recipe prepare` runs too; this module tokenizes what it
returns. Everything is checked at submit,
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
from dataclasses import dataclass
from pathlib import Path

from contract.data.sft_dataset import SftSpec, read_sft_rows
from services.common.models.directory import load_tokenizer


@dataclass(frozen=True)
class SftExample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool] | None
    """Per response token: in the loss (True) or context (False, a later user turn); None = all in the loss."""


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
    line or row, and the field of the first bad one (its fields checked first by contract.data.sft_dataset,
    which `lockstep recipe prepare` runs too)."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    rows = read_sft_rows(spec)
    eos = load_tokenizer(model_dir).eos_token_id
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate(model_dir) if rows[0].messages is not None else None
    out = []
    for row in rows:
        at = row.where
        if template is not None:
            example = _conversation(template, tokenizer, row.messages, at)
        else:
            prompt = tokenizer.encode(row.prompt, add_special_tokens=False).ids
            completion = tokenizer.encode(row.completion, add_special_tokens=False).ids
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
