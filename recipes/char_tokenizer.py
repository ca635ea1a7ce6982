"""A character-level tokenizer built locally (no hub download), saved in HF layout.

The demo needs a tokenizer that every component loads the same way
(`AutoTokenizer.from_pretrained(model_dir)` in the trainer, the rollout engine,
SGLang and the coordinator), so it is a real `tokenizers` object wrapped in
`PreTrainedTokenizerFast` and written with `save_pretrained`, not a Python
dict that only this repo understands.

Why character level: arithmetic answers are compared digit by digit, and a
one-token-per-character vocabulary keeps the model tiny (about 100 rows of
embedding) and makes every response length predictable (answer digits + eos).

Contract:
- `encode(text)` adds no special tokens (no BOS, no EOS): the prompt a task
  writes is exactly the ids the policy sees (tasks/base.py: "the tokenizer adds
  nothing").
- `decode(encode(text)) == text` for every text made of vocabulary characters
  (printable ASCII and newline).
- Special tokens have fixed ids: pad=0, bos=1, eos=2, unk=3. Characters outside
  the vocabulary encode to unk (they never round-trip; the tests say so).
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

# Printable ASCII (space .. tilde) plus newline. string.printable also holds
# \t\r\x0b\x0c, which only create ambiguity in round trips; leave them out.
CHARACTERS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")


@dataclass(frozen=True)
class CharVocab:
    """The token table: special tokens first (fixed ids), then one token per character."""

    characters: tuple[str, ...] = CHARACTERS
    """Characters with their own token, in id order after the special tokens."""

    def tokens(self) -> list[str]:
        chars = list(dict.fromkeys(self.characters))  # stable de-duplication
        clash = [c for c in chars if c in SPECIAL_TOKENS]
        if clash:
            raise ValueError(f"characters: {clash!r} collide with special tokens")
        return list(SPECIAL_TOKENS) + chars

    @property
    def size(self) -> int:
        return len(self.tokens())


def build_char_tokenizer(vocab: CharVocab | None = None):
    """Return a `PreTrainedTokenizerFast` over `vocab` (default: printable ASCII + newline)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocab or CharVocab()
    token_to_id = {tok: i for i, tok in enumerate(vocab.tokens())}
    tok = Tokenizer(models.WordLevel(vocab=token_to_id, unk_token=UNK_TOKEN))
    # Every character is its own pre-token; [\s\S] (not '.') so newline is one too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens with no separator; the default would insert spaces.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    # No post-processor: encode() must never add BOS/EOS on its own.
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        # Left padding so batched greedy generation continues each prompt at its end.
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    ids = [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    if ids != [PAD_ID, BOS_ID, EOS_ID, UNK_ID]:  # guard the fixed-id contract
        raise AssertionError(f"special token ids drifted: {ids}")
    return fast


def save_char_tokenizer(out_dir: str | Path, vocab: CharVocab | None = None):
    """Build the tokenizer and write it into `out_dir` (HF layout); returns the tokenizer."""
    tok = build_char_tokenizer(vocab)
    tok.save_pretrained(str(out_dir))
    # transformers 5 records its internal class name ("TokenizersBackend"), which
    # transformers 4.x (and tools pinned to it) cannot resolve. The public alias
    # loads the same tokenizer.json under both major versions.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return tok
