"""Tiny mixture-of-experts causal LMs (Qwen3-MoE, Qwen2-MoE with a shared expert) built in code from a seed.

Like recipes/tiny_model.py for the dense Qwen3: the stock Hugging Face classes, configured, initialised
deterministically (torch's CPU generator seeded inside fork_rng) and written as a normal model directory
with the character tokenizer, so the trainer and the engines load it through `from_pretrained`.
Widths are multiples of 8 so that torch's grouped matmul (16-byte aligned strides) takes them in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, CharVocab
from recipes.tiny_model import save_model_dir

FAMILIES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class TinyMoeConfig:
    """Shape of a tiny MoE model. Defaults: 8 experts, top-2, 2 layers (the issue's acceptance model)."""

    family: str = "qwen3_moe"
    """'qwen3_moe' (routed experts only) or 'qwen2_moe' (plus a gated shared expert)."""
    hidden_size: int = 64
    """Residual width."""
    num_hidden_layers: int = 2
    """Transformer blocks, each with an MoE MLP."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA)."""
    head_dim: int = 16
    """Per-head width."""
    num_experts: int = 8
    """Routed experts per layer."""
    num_experts_per_tok: int = 2
    """Experts each token goes through (top-k)."""
    moe_intermediate_size: int = 32
    """Width of each routed expert's SwiGLU MLP."""
    shared_expert_intermediate_size: int = 64
    """Width of the shared expert (qwen2_moe only)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k weights to sum to 1 (Qwen3-30B-A3B does)."""
    max_position_embeddings: int = 128
    """Longest sequence the model is configured for."""
    initializer_range: float = 0.02
    """Std of the normal init."""

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: must be one of {list(FAMILIES)}, got {self.family!r}")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_experts", "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok: must be <= num_experts ({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")


def moe_config(cfg: TinyMoeConfig, vocab_size: int):
    """The transformers config (Qwen3MoeConfig or Qwen2MoeConfig) for `cfg`."""
    cfg.validate()
    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size * 2,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        initializer_range=cfg.initializer_range, rms_norm_eps=1e-6, use_sliding_window=False, attention_dropout=0.0,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[], output_router_logits=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, dtype="float32")
    if cfg.family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(head_dim=cfg.head_dim, attention_bias=False, architectures=["Qwen3MoeForCausalLM"],
                              **common)
    from transformers import Qwen2MoeConfig

    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("head_dim: qwen2_moe derives it as hidden_size / num_attention_heads")
    return Qwen2MoeConfig(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=True,
                          architectures=["Qwen2MoeForCausalLM"], **common)


def build_tiny_moe(cfg: TinyMoeConfig | None = None, *, seed: int, vocab: CharVocab | None = None):
    """A freshly initialised MoE causal LM (float32, CPU, eval mode), deterministic in `seed`."""
    from transformers import AutoModelForCausalLM

    cfg = cfg or TinyMoeConfig()
    vocab = vocab or CharVocab()
    hf_cfg = moe_config(cfg, vocab.size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_cfg)
    model.to(torch.float32)
    model.eval()
    return model


def build_moe_model_dir(out_dir: str | Path, cfg: TinyMoeConfig | None = None, *, seed: int) -> Path:
    """Build the untrained tiny MoE model from `seed` and write its directory (model + tokenizer)."""
    return save_model_dir(build_tiny_moe(cfg, seed=seed), out_dir)
