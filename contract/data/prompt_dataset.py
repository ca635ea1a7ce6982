"""How a task reads its prompts from a data file: the `dataset` block of a task's options.

Pydantic only (no pyarrow, no datasets): the coordinator's readers (services/coordinator/tasks/
prompt_rows.py) and the docs use these names. docs/tracking.md#prompt-datasets says what each means.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_NAME = 256


class PromptDataset(BaseModel):
    """Format and chat rendering of a task's data files (its path, heldout_path and eval sets alike)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal["auto", "jsonl", "parquet", "hf_disk"] = Field(
        "auto", description="'jsonl': one JSON object per line; 'parquet': a Parquet file (verl's format), one "
        "problem per row; 'hf_disk': a directory a Hugging Face `datasets` save_to_disk wrote; 'auto': a "
        "directory is hf_disk, a *.parquet file parquet, anything else jsonl.")
    split: str = Field("train", min_length=1, max_length=MAX_NAME, description="The split read from an hf_disk "
                       "directory holding a DatasetDict (a lone Dataset has none to choose).")
    messages_field: str = Field(
        "", max_length=MAX_NAME, description="Field holding a chat: a list of {role, content} messages (strings), "
        "rendered through the model's chat template with the generation prompt appended, instead of "
        "prompt_template over question_field. The template's sha256 is recorded in the run's fingerprint. Empty: "
        "plain prompts.")
