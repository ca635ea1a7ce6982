"""Reference scorers the decoder tests compare against (no part of the decoder)."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch

from kernels.logprob import token_logprobs
from recipes.tiny_model import TinyQwen3Config
from services.common.models.loading import load_causal_lm
from services.rollout.types import SamplingConfig

# Large init std: distributions far from uniform, so a position or cache bug moves log-probs by far more
# than the tolerances.
TINY = TinyQwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, max_position_embeddings=128, initializer_range=0.3)
PROMPTS = [(3, 4), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), (5, 9, 2, 13), (7,), (6, 6, 6, 6, 6, 6)]
SEEDS = [11, 1000, 77, 5, 2**40 + 1]
TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-2}


def loaded(model_dir: Path, dtype: str) -> torch.nn.Module:
    model = load_causal_lm(model_dir, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def sampling(**kw) -> SamplingConfig:
    return SamplingConfig(**{"temperature": 0.8, "max_new_tokens": 12, **kw})


def dynamic_cache_logprobs(model, prompts, responses, temperature: float, pad: int = 0) -> list[torch.Tensor]:
    """The engine's previous generation path, teacher-forced on `responses`: one left-padded batch, HF's
    DynamicCache, one column per step, the attention mask hiding the padding."""
    from transformers import DynamicCache

    lmax = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), lmax), pad)
    mask = torch.zeros((len(prompts), lmax), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, lmax - len(p):] = torch.tensor(p)
        mask[b, lmax - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       **{cache_arg: cache}).logits[:, -1]
        next_pos = mask.sum(-1, keepdim=True)
        for t in range(max(len(r) for r in responses)):
            tok = torch.tensor([r[t] if t < len(r) else pad for r in responses])
            out.append(token_logprobs(logits, tok, temperature=temperature)[0])
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype)], dim=-1)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                           **{cache_arg: cache}).logits[:, -1]
            next_pos = next_pos + 1
    steps = torch.stack(out, dim=1)
    return [steps[b, :len(r)] for b, r in enumerate(responses)]


def batch_invariant_scorer(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a fresh copy, not the decoder's) set up as the trainer runs it in true_on_policy: patched onto
    the batch-invariant ops, attention through the packed HF path (`packed_recompute` forces the registry's
    batch_invariant backend)."""
    from kernels.attention import register_hf_attention
    from kernels.batch_invariant.hf import make_batch_invariant

    model.set_attn_implementation(register_hf_attention())
    model.eval().requires_grad_(False)
    make_batch_invariant(model)
    return model


def packed_recompute(scorer: torch.nn.Module, prompts, responses, temperature: float) -> list[list[float]]:
    """Every sequence prompt+response in ONE packed forward of `scorer` (the trainer's packed layout and
    attention backend); each response token scored by the trainer's true_on_policy head
    (services.trainer.model.policy.score_hidden_batch_invariant)."""
    from kernels.attention import REGISTRY, packed_forward_kwargs
    from services.trainer.model.policy import score_hidden_batch_invariant

    device = next(scorer.parameters()).device
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lens.tolist()])
    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        hidden = scorer.model(input_ids=torch.tensor([t for s in seqs for t in s], device=device)[None],
                              **packed_forward_kwargs(positions.to(device), cu.to(device),
                                                      int(lens.max()))).last_hidden_state[0]
        rows = torch.cat([torch.arange(int(cu[b]) + len(p) - 1, int(cu[b + 1]) - 1) for b, p in enumerate(prompts)])
        targets = torch.tensor([t for r in responses for t in r], device=device)
        mask = torch.ones(len(rows), dtype=torch.bool, device=device)
        logp = score_hidden_batch_invariant(hidden[rows.to(device)], scorer.get_output_embeddings().weight, mask,
                                            targets, temperature=temperature)[0].float().tolist()
    out, at = [], 0
    for r in responses:
        out.append(logp[at:at + len(r)])
        at += len(r)
    return out
