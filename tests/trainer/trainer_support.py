"""Helpers of the trainer tests: a tiny Qwen3 model directory and on-policy trajectories.

The model is built in the test (no hub): Qwen3Config with vocab 32, hidden 32,
2 layers, 4 heads / 2 KV heads, plus a word-level tokenizer so checkpoints can
be checked for tokenizer files. Rollout log-probs are computed from the same
weights, one sequence at a time, with the shared log-prob definition — the
way the rollout engine reports them — so step-1 IW must be ~1.

A plain module (not conftest.py) so that test modules import it by a name no
other test directory's conftest can shadow.
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 32


def build_tiny_model_dir(path: Path, *, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(str(path))
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    ).save_pretrained(str(path))
    return path


def make_episodes(n_groups: int = 2, per_group: int = 3, *, seed: int = 1) -> list[dict]:
    """Deterministic prompts/responses of varied lengths with rewards (no log-probs yet)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for si in range(per_group):
            resp = torch.randint(3, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
            out.append({
                "group_id": f"g{gi}", "sample_id": f"g{gi}/{si}",
                "prompt": prompt.tolist(), "response": resp.tolist(),
                "reward": float((gi + si) % 2),
            })
    return out


@torch.no_grad()
def rollout_logprobs(model, prompt: list[int], response: list[int], *, temperature: float = 1.0) -> list[float]:
    """Score `response` given `prompt` like the rollout engine: one unpadded sequence, shared kernel."""
    from kernels.logprob import token_logprobs

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0]
    p = len(prompt)
    sel = logits[p - 1 : p - 1 + len(response)]
    logp, _ = token_logprobs(sel, torch.tensor(response, device=device), temperature=temperature)
    return logp.tolist()


def current_policy(trainer, model_dir: Path, *, device: str = "cpu") -> torch.nn.Module:
    """A plain HF model holding what the trainer computes with now: the compute-dtype cast of its masters.

    What a rollout engine synced to the trainer holds (a mixture-of-experts model on the recorded routers and
    fast experts an engine in `fast` mode runs). Works for a multi-rank trainer too (the masters are gathered
    by every rank), where calling rank 0's sharded module alone would wait for the others."""
    from transformers import AutoModelForCausalLM

    from kernels.moe.hf_blocks import observe_routing
    from services.common.models.loading import resolve_dtype

    dtype = resolve_dtype(trainer.run.config.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in trainer.master_state_dict().items()})
    observe_routing(model)  # nothing for a dense model
    return model.to(device)


def on_policy_request(trainer, model_dir: Path, step: int, *, n_groups: int, per_group: int, seed: int):
    """StepRequest of step `step`: make_episodes(seed=seed + step) scored by the trainer's current weights, as a
    rollout synced to it would report them, with GRPO advantages."""
    from services.trainer.data.batching import TrainSample
    from services.trainer.loss.surrogate import group_advantages
    from services.trainer.data.wire import StepRequest

    policy = current_policy(trainer, model_dir, device=trainer.device)
    eps = make_episodes(n_groups=n_groups, per_group=per_group, seed=seed + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                           torch.tensor(rollout_logprobs(policy, e["prompt"], e["response"])), e["reward"], a)
               for e, a in zip(eps, adv)]
    return StepRequest(trainer.run.run_id, step, step - 1, samples)
