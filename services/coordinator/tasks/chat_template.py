"""A model directory's chat template, rendered as transformers' apply_chat_template renders it.

The template comes from where `save_pretrained` puts it (chat_template.jinja, or tokenizer_config.json's
chat_template: a string, or the one named "default" of a list) and is rendered by transformers' own
renderer (a sandboxed Jinja environment), with the tokenizer's special tokens as variables and the
generation prompt appended: the prompt text the model was tuned on, which the run's tokenizer then encodes
without adding anything. Its sha256 is recorded in the run's fingerprint, so two runs whose prompts were
rendered differently say so. transformers is imported only for a run with chat prompts (no torch).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from services.coordinator.tasks.base import Problem

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        self.template, self.special_tokens = template, special_tokens
        self.sha256 = hashlib.sha256(template.encode()).hexdigest()

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate:
        """ValueError naming the model directory when it has no chat template."""
        p = Path(path)
        try:
            config = json.loads((p / "tokenizer_config.json").read_text())
        except FileNotFoundError:
            config = {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {p / 'tokenizer_config.json'}: {exc}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # [{"name": ..., "template": ...}], as transformers writes several
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = p / "chat_template.jinja"
        if jinja.is_file():  # where transformers saves it now; it wins over the config's, as there
            template = jinja.read_text()
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"{p} has no chat template (chat_template.jinja, or chat_template in "
                             "tokenizer_config.json): chat prompts need one")
        tokens = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        return cls(template, tokens)

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        chat = [{"role": role, "content": content} for role, content in messages]
        rendered, _ = render_jinja_template([chat], chat_template=self.template, add_generation_prompt=True,
                                            **self.special_tokens)
        return rendered[0]

    def check(self, problems: Iterable[Problem], field: str) -> None:
        """Render every chat problem now (at submit): ValueError naming `field` and the problem (file:row)."""
        for problem in problems:
            if problem.messages is None:
                continue
            try:
                self.render(problem.messages)
            except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or raise_exception() in the template
                raise ValueError(f"{field}: the chat template cannot render {problem.problem_id}: {exc}") from None
