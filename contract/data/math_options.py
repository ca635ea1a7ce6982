"""The math task's options (a run spec's task.options) and the format of its JSONL problem files.

Pydantic only, no torch and no math-verify: the coordinator's math task
(services/coordinator/tasks/math_dataset.py) reads its files with these, and
`lockstep recipe prepare` checks a recipe's files against the same fields,
limits and answer marker before anything is submitted.
"""
from __future__ import annotations

import string

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract.data.prompt_dataset import PromptDataset

MAX_DATASET_BYTES = 256 * 1024 * 1024
"""Largest JSONL file a run may name: every reference answer is parsed when the run is submitted."""
MAX_DATASET_LINES = 100_000
"""Most lines (problems) of one JSONL file, for the same reason (GSM8K's train split has 7,473)."""
MAX_TEXT_FIELD = 4096
"""Longest field name, marker, template or path in the options."""


def check_prompt_template(template: str) -> str:
    """`template` if its only replacement fields are plain `{question}` (no format spec, conversion,
    attribute or index: those would let a run spec allocate without bound or read object attributes)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"must have one {{question}} field and no other ({exc})") from None
    fields = [(name, spec, conversion) for _, name, spec, conversion in parsed if name is not None]
    for name, spec, conversion in fields:
        if name != "question":
            raise ValueError(f"must have one {{question}} field and no other (found {{{name}}})")
        if spec or conversion:
            raise ValueError("{question} takes no format spec or conversion (write it as plain {question})")
    if not fields:
        raise ValueError("has no {question} field")
    return template


class MathConfig(BaseModel):
    """Where the problems are and how prompts, answers and splits are made (the run spec's task.options)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str = Field("", max_length=MAX_TEXT_FIELD,
                      description="File of problems (JSONL unless `dataset.format` says otherwise), visible to the "
                      "coordinator.")
    question_field: str = Field("question", min_length=1, max_length=MAX_TEXT_FIELD,
                                description="Field holding the question text.")
    answer_field: str = Field("answer", min_length=1, max_length=MAX_TEXT_FIELD, description="Field holding the "
                              "reference answer (or a solution ending in it; see answer_marker).")
    answer_marker: str = Field("", max_length=MAX_TEXT_FIELD, description="If set, the reference answer is the text "
                               "after the last occurrence of this marker ('####' for GSM8K).")
    prompt_template: str = Field(
        "{question}\nPut the final answer in \\boxed{{}}.\n", max_length=MAX_TEXT_FIELD,
        description="Python format string with one plain {question} field (literal braces doubled); no format "
        "specs or conversions.")
    heldout_path: str = Field("", max_length=MAX_TEXT_FIELD, description="Separate held-out JSONL file; empty: "
                              "hold out heldout_size problems of `path`.")
    heldout_size: int = Field(100, ge=1, le=MAX_DATASET_LINES, description="Problems held out of `path` when there "
                              "is no heldout_path (ignored otherwise).")
    seed: int = Field(0, ge=0, le=2**62, description="Seeds the shuffle that picks the held-out problems.")
    timeout_s: int = Field(5, ge=1, le=600, description="math-verify's parse and verify timeouts for one response, "
                           "in seconds.")
    reward_workers: int = Field(2, ge=1, le=256, description="Worker processes that score responses.")
    dataset: PromptDataset = Field(default_factory=PromptDataset, description="Format of path, heldout_path and "
                                   "eval sets (JSONL, Parquet, a saved Hugging Face dataset) and chat prompts.")

    @field_validator("prompt_template")
    @classmethod
    def _plain_placeholder(cls, v: str) -> str:
        return check_prompt_template(v)


def reference_answer(raw: str, marker: str) -> str:
    """The answer part of a dataset's answer field."""
    if marker:
        if marker not in raw:
            raise ValueError(f"does not contain answer_marker {marker!r}")
        raw = raw.rsplit(marker, 1)[1]
    raw = raw.strip()
    if not raw:
        raise ValueError("is empty")
    return raw
