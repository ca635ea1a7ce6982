"""What the coordinator reads from a model directory, without torch or transformers.

The coordinator checks that a run's `model_path` is a Hugging Face model
directory at submit time, and tokenizes prompts and decodes responses during
the run. Neither needs the model code, so neither imports torch: the tokenizer
is the directory's `tokenizer.json` run by the `tokenizers` library, the same
Rust tokenizer transformers' `PreTrainedTokenizerFast` (what
`AutoTokenizer.from_pretrained` gives the trainer and the rollout engines)
wraps, so prompt ids and decoded text are the ones it would give.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer


def check_model_dir(path: str | Path) -> Path:
    """Fail at once, naming the path, when it is not a Hugging Face model directory."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model_path: {p} is not a directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model_path: {p} has no config.json (not a Hugging Face model directory)")
    return p


def layout_digest(path: str | Path) -> str:
    """sha256 over the name and bytes of every top-level file of a model directory except its weights
    (*.safetensors, *.bin and their shard indexes): two directories with one digest describe the same
    architecture, tokenizer and generation settings, whatever their weights."""
    h = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if not f.is_file() or f.name.endswith((".safetensors", ".bin", ".index.json")):
            continue
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


class ModelTokenizer:
    """A model directory's fast tokenizer: encode, decode and the end-of-sequence id."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model_path: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model_path: {path} is not a JSON object")
    return data


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path) -> ModelTokenizer:
    """The tokenizer of model directory `path`; FileNotFoundError / ValueError naming the file otherwise."""
    p = check_model_dir(path)
    tokenizer_file = p / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"model_path: {p} has no tokenizer.json (a fast tokenizer is required; "
                                "`AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes one)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
        raise ValueError(f"model_path: cannot load {tokenizer_file}: {exc}") from None
    config = _read_json(p / "tokenizer_config.json")
    if config.get("clean_up_tokenization_spaces") and type(tokenizer.model).__name__ != "BPE":
        # transformers would rewrite decoded text (" ." -> "."); the run's decoded responses would differ.
        raise ValueError(f"model_path: {p / 'tokenizer_config.json'} sets clean_up_tokenization_spaces, "
                         "which the coordinator does not apply; set it to false")
    eos = _token_content(config.get("eos_token"))
    if eos is None:
        eos = _token_content(_read_json(p / "special_tokens_map.json").get("eos_token"))
    eos_id = None if eos is None else tokenizer.token_to_id(eos)
    if eos is not None and eos_id is None:
        raise ValueError(f"model_path: eos_token {eos!r} is not in {tokenizer_file}'s vocabulary")
    return ModelTokenizer(tokenizer, eos_id)
