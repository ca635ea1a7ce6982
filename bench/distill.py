"""On-policy distillation's teacher scoring: tokens/s of the trainer's teacher pass against its physical limits.

Prints one JSON object (and writes it to --out). GPU run (the lead's; H200 or H100), exact command:

    .venv/bin/python bench/distill.py --shape qwen3-4b --sequences 256 --seq-len 2048 --out bench/distill.json

An SFT step's MFU at the 4B shape beside the RL step's is bench/train.py's `+sft` flag, in one process:

    .venv/bin/python bench/train.py --runs qwen3-4b@16384+ac,qwen3-4b@16384+ac+sft --out bench/sft_vs_rl.json

CPU smoke (checks the script end to end on a tiny shape; its numbers mean nothing):

    .venv/bin/python bench/distill.py --small

What runs: a Qwen3-shaped teacher (random init, bf16 on the GPU) is loaded by the trainer's own
`services.trainer.teacher.load_teacher` and scores `--sequences` sequences of `--seq-len` tokens (a
quarter prompt, the rest response) in the trainer's packed microbatches (`--microbatch-tokens`) with
`score_microbatch`: the teacher's log-prob of every response token (the log-prob head) and its argmax (one
more lm_head GEMM on the response rows), exactly the pass a distillation step makes before its update.
Numerics 'fast' (the default) and, with `--true-on-policy`, the batch-invariant kernels.

Measured in the same process:
- `teacher_tokens_per_s`: sequence tokens (prompt + response) scored per second, over `--reps` passes after
  one warm-up;
- `baseline_tokens_per_s`: the plain Hugging Face forward of the same model on the same sequences, padded
  rows of `--baseline-rows`, then log_softmax over [rows, L, V] in float32 and a gather (what a teacher
  without the log-prob head would run);
- the forward's limits: `compute_limit_tokens_per_s` = the bf16 GEMM rate measured here (8192^3) over the
  forward's FLOPs per token (2 x non-embedding parameters, 2 x V x H for the head and 2 x V x H for the
  argmax per response token, causal attention 2 L^2 (heads x head_dim) per layer per sequence);
  `hbm_limit_tokens_per_s` = tokens per microbatch over the time to read the bf16 weights once at the
  device-to-device copy bandwidth measured here (every microbatch reads every weight). The pass can be no
  faster than the smaller; `fraction_of_limit` is the measured rate over it.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}
VOCAB = 151936
TINY_VOCAB = 512


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds(fn, device: str, reps: int) -> float:
    fn()  # warm-up (kernel selection, allocator)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / reps


def gemm_tflops(device: str, n: int) -> float:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n ** 3 / seconds(lambda: a @ b, device, 10) / 1e12


def copy_bandwidth_gbs(device: str, nbytes: int) -> float:
    """Device-to-device copy: bytes read plus bytes written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), device, 10) / 1e9


def write_model(shape: str, vocab: int, directory: Path, device: str) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, rope_theta=1e6, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model.to(dtype).save_pretrained(str(directory))
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head = 0 if cfg.tie_word_embeddings else model.get_output_embeddings().weight.numel()
    del model
    return {"params": params, "non_embedding_params": params - embedding - head,
            "weight_bytes": params * (2 if dtype == torch.bfloat16 else 4)}


def samples(n: int, length: int, vocab: int):
    from services.trainer.data.batching import TrainSample

    prompt = length // 4
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(4, vocab, (length,), generator=g)
        out.append(TrainSample(f"s{i}", f"g{i // 8}", ids[:prompt], ids[prompt:], torch.zeros(length - prompt),
                               0.0, 0.0))
    return out


def forward_flops_per_token(counts: dict, cfg: dict, vocab: int, length: int) -> float:
    response_share = (length - length // 4) / length
    attention = 2 * length * cfg["num_attention_heads"] * cfg["head_dim"] * cfg["num_hidden_layers"]  # 2 L^2 d / L
    return 2 * counts["non_embedding_params"] + 2 * 2 * vocab * cfg["hidden_size"] * response_share + attention


def baseline_seconds(teacher, batch, rows: int, device: str) -> float:
    """HF forward on padded rows, float32 log_softmax over the vocabulary, gather of the response tokens."""
    lm = teacher.lm

    def run() -> None:
        with torch.no_grad():
            for start in range(0, len(batch), rows):
                part = batch[start:start + rows]
                ids = torch.stack([torch.cat([s.prompt_ids, s.response_ids]) for s in part]).to(device)
                logits = lm(input_ids=ids[:, :-1]).logits.float()
                logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])
                del logits, logp

    return seconds(run, device, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--microbatch-tokens", type=int, default=32768)
    ap.add_argument("--baseline-rows", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--true-on-policy", action="store_true", help="score on the batch-invariant kernels")
    ap.add_argument("--small", action="store_true", help="CPU smoke: tiny shape, 8 sequences of 64 tokens")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.small:
        args.shape, args.sequences, args.seq_len, args.microbatch_tokens, args.reps = "tiny", 8, 64, 256, 1
    device = "cpu" if args.small else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/distill.py needs a GPU (or --small for the CPU smoke)")
    vocab = TINY_VOCAB if args.small else VOCAB

    from contract.trainer_run import TrainerRunConfig
    from services.trainer.run_setup import build_microbatches
    from services.trainer.teacher import load_teacher, score_microbatch

    with tempfile.TemporaryDirectory() as tmp:
        counts = write_model(args.shape, vocab, Path(tmp), device)
        config = TrainerRunConfig.model_validate({
            "dtype": "float32" if args.small else "bfloat16", "microbatch_tokens": args.microbatch_tokens,
            "numerics": "true_on_policy" if args.true_on_policy else "fast", "teacher": {"model_path": tmp}})
        if args.true_on_policy:
            from kernels.attention import REGISTRY
            from services.trainer.run_setup import attention_policy

            REGISTRY.set_policy(attention_policy(config))
        teacher = load_teacher(config, device, student_vocab_size=vocab)
    batch = samples(args.sequences, args.seq_len, vocab)
    microbatches = [mb.to(device) for mb in build_microbatches(batch, config)]

    def score() -> None:
        for mb in microbatches:
            score_microbatch(teacher, mb, temperature=1.0)

    tokens = args.sequences * args.seq_len
    scoring = seconds(score, device, args.reps)
    baseline = baseline_seconds(teacher, batch, args.baseline_rows, device)
    gemm = gemm_tflops(device, 1024 if args.small else 8192)
    bandwidth = copy_bandwidth_gbs(device, (1 << 24) if args.small else (4 << 30))
    cfg = SHAPES[args.shape]
    flops = forward_flops_per_token(counts, cfg, vocab, args.seq_len)
    compute_limit = gemm * 1e12 / flops
    hbm_limit = (tokens / len(microbatches)) / (counts["weight_bytes"] / (bandwidth * 1e9))
    rate = tokens / scoring
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "small": args.small,
        "shape": args.shape, "vocab": vocab, "sequences": args.sequences, "seq_len": args.seq_len,
        "numerics": config.numerics, "microbatch_tokens": args.microbatch_tokens, "microbatches": len(microbatches),
        **counts,
        "teacher_seconds": round(scoring, 4), "teacher_tokens_per_s": round(rate, 1),
        "baseline_tokens_per_s": round(tokens / baseline, 1), "speedup_over_baseline": round(baseline / scoring, 3),
        "gemm_tflops": round(gemm, 2), "copy_bandwidth_gbs": round(bandwidth, 1),
        "forward_flops_per_token": flops,
        "compute_limit_tokens_per_s": round(compute_limit, 1), "hbm_limit_tokens_per_s": round(hbm_limit, 1),
        "fraction_of_limit": round(rate / min(compute_limit, hbm_limit), 4),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
