"""Whether two model directories share one tokenizer vocabulary, token for token (on-policy distillation).

A teacher scores the student's sampled token ids: the ids must mean the same tokens on both sides, or the
teacher's log-probs are of other text. Read from each directory's tokenizer.json with the `tokenizers`
library (the coordinator imports no torch), added tokens included.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from services.common.models.directory import load_tokenizer


def _tokens_by_id(path: str | Path) -> dict[int, str]:
    load_tokenizer(path)  # FileNotFoundError / ValueError naming what is wrong with the directory
    vocab = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return {i: token for token, i in vocab.items()}


def vocabulary_difference(student: str | Path, teacher: str | Path) -> str | None:
    """None when both tokenizers map every id to the same token; otherwise the first differing id, saying
    what each side has there. Raises FileNotFoundError / ValueError for a directory without a usable
    tokenizer."""
    mine, theirs = _tokens_by_id(student), _tokens_by_id(teacher)
    for i in sorted(set(mine) | set(theirs)):
        a, b = mine.get(i), theirs.get(i)
        if a != b:
            def show(token: str | None) -> str:
                return "no token" if token is None else repr(token)
            return (f"the first differing token is id {i}: the student's tokenizer has {show(a)}, the teacher's "
                    f"{show(b)} (vocabularies of {len(mine)} and {len(theirs)} tokens); a teacher must share "
                    "the student's tokenizer")
    return None
