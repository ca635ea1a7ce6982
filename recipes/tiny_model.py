"""A tiny Qwen3-architecture causal LM built deterministically in code from a seed.

The demo and the tests need a real model that every component loads through
the ordinary Hugging Face path (`AutoModelForCausalLM.from_pretrained(dir)` in
the trainer and the embedded engine; SGLang later), with no download. So this
module only *configures* the stock `Qwen3ForCausalLM` (no forked model code:
trainer and engine run one model definition) and writes a
normal model directory: config.json, generation_config.json,
model.safetensors and the character tokenizer.

Same seed + same `TinyQwen3Config` -> bitwise-identical initial weights: the
weights are drawn on CPU in float32 from torch's global generator, seeded
inside `fork_rng` (so the caller's RNG state is untouched), in the module's
fixed construction order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, CharVocab, save_char_tokenizer


@dataclass(frozen=True)
class TinyQwen3Config:
    """Shape of the tiny model. Defaults are the demo's (see recipes/tiny_arith)."""

    hidden_size: int = 128
    """Residual width."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads; fewer than query heads so the demo exercises GQA like real Qwen3."""
    head_dim: int = 32
    """Per-head width (Qwen3 sets it explicitly rather than hidden/heads)."""
    intermediate_size: int = 384
    """SwiGLU MLP width."""
    max_position_embeddings: int = 128
    """Longest prompt + response the model is configured for (demo sequences are ~15 tokens)."""
    rope_theta: float = 10000.0
    """RoPE base; the 1e6 of large Qwen3 models only matters for long contexts."""
    tie_word_embeddings: bool = False
    """Untied so every parameter is its own tensor: weight sync and checkpoints
    then map one name to one tensor with no aliasing to special-case."""
    initializer_range: float = 0.02
    """Std of the normal init (Qwen3's default)."""

    def validate(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: must divide num_attention_heads ({self.num_attention_heads}),"
                f" got {self.num_key_value_heads}"
            )


def qwen3_config(cfg: TinyQwen3Config, vocab_size: int):
    """The transformers `Qwen3Config` for `cfg`, with the tokenizer's special ids filled in."""
    from transformers import Qwen3Config

    cfg.validate()
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],
    )


def build_tiny_qwen3(cfg: TinyQwen3Config | None = None, *, seed: int, vocab: CharVocab | None = None):
    """A freshly initialised `Qwen3ForCausalLM` (float32, CPU, eval mode), deterministic in `seed`."""
    from transformers import Qwen3ForCausalLM

    cfg = cfg or TinyQwen3Config()
    vocab = vocab or CharVocab()
    hf_cfg = qwen3_config(cfg, vocab.size)
    # Init draws from torch's global CPU generator; fork it so building a model
    # neither depends on nor disturbs the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(hf_cfg)
    model.to(torch.float32)
    model.eval()
    return model


def save_model_dir(model, out_dir: str | Path, vocab: CharVocab | None = None) -> Path:
    """Write `model` + the char tokenizer as a Hugging Face model directory."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    # Greedy by default and stop at eos: anything that calls generate() on this
    # dir without arguments (SGLang's defaults, a user in a notebook) gets the
    # deterministic answer rather than transformers' sampling defaults.
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(str(out))
    save_char_tokenizer(out, vocab)
    return out


def build_model_dir(out_dir: str | Path, cfg: TinyQwen3Config | None = None, *, seed: int) -> Path:
    """Build the untrained tiny model from `seed` and write its directory (model + tokenizer)."""
    return save_model_dir(build_tiny_qwen3(cfg, seed=seed), out_dir)
