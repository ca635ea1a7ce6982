"""A generative judge's throughput on a scorer replica, and how much of a full step the scorer is busy while
the policy still generates. Prints one JSON object (and writes it to --out).

GPU run (the lead's; H200 or H100), exact command:

    .venv/bin/python bench/judge.py --out bench/results/judge_h200.json

CPU smoke (checks the script end to end on a tiny shape; its numbers mean nothing):

    .venv/bin/python bench/judge.py --small

What runs, in one process on one device:
- a Qwen3-0.6B-shaped judge (random init, bf16 on a GPU; the char tokenizer with the 0.6B vocabulary's rows)
  served by the scorer role's own code (services/rollout/scorer/role.py over the torch engine: the template
  rendered, greedy decoding up to --verdict-tokens by the engine's continuous scheduler) scores --responses
  responses of --response-tokens tokens each, as one Score call of that many items. Measured:
  `scored_samples_per_s` over --reps calls after a warm-up;
- baseline, same process: the same judge scoring --baseline-items items one call each (what a reward service
  without batching does); `speedup_over_baseline` is the ratio;
- the limit, same process: each call is at least its prefill FLOPs (2 x non-embedding parameters per prompt
  token, plus the causal attention's) at the bf16 GEMM rate measured here (8192^3), plus --verdict-tokens
  decode steps each reading every weight once at the copy bandwidth measured here;
  `fraction_of_limit` = measured / limit;
- a full step: a policy of the same shape (the torch engine) generates --responses samples of
  --response-tokens, and the judge scores them, (a) after generation as one batch, as a step with one policy
  replica does, and (b) shard by shard (--shards shards, as a step with that many policy replicas: the
  coordinator scores a replica's samples as soon as they arrive, fleet.generate's on_shard), the judge on its
  own thread and CUDA stream. `scorer_busy_overlap` is the fraction of the judge's busy time during which the
  policy was generating, and `step_seconds_*` the wall time of each schedule.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, vocab_size=512),
}
TEMPLATE = "Question: {prompt}\nReference: {reference}\nResponse: {response}\nScore (0-10):"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gemm_tflops(device: str, n: int) -> float:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    synchronize(device)
    return 2 * n ** 3 * 10 / (time.perf_counter() - start) / 1e12


def copy_bandwidth_gbs(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    synchronize(device)
    return 2 * nbytes * 10 / (time.perf_counter() - start) / 1e9  # read + write


def write_model(shape: str, directory: Path, seed: int, max_positions: int) -> dict:
    """A random Qwen3 of `shape` with the char tokenizer (its rows beyond the tokenizer's are never read)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from recipes.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, save_char_tokenizer

    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=max_positions, bos_token_id=BOS_ID,
                      eos_token_id=EOS_ID, pad_token_id=PAD_ID, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 1e6},
                      architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_char_tokenizer(directory)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    return {"parameters": total, "non_embedding_parameters": total - embedding,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def engine(model_dir: Path, device: str, batch: int, context: int):
    from contract.engine_options import TorchEngineConfig
    from services.rollout.embedded.torch_engine import TorchEngine

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    e = TorchEngine.from_config_json(TorchEngineConfig(dtype=dtype, device=device, max_batch_size=batch,
                                                       max_context_tokens=context).model_dump_json())
    e.load(str(model_dir), 0)
    return e


def texts(n: int, chars: int, seed: int) -> list[tuple[str, str, str]]:
    """(prompt, response, reference) of n items, the response `chars` characters (one token each)."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-=.,"
    return [(f"What is {rng.randint(10, 99)}+{rng.randint(10, 99)}?", "".join(rng.choice(alphabet) for _ in range(chars)),
             str(rng.randint(20, 198))) for _ in range(n)]


def score_request(items, verdict_tokens: int, first: int = 0):
    from proto import lockstep_pb2 as pb

    return pb.ScoreRequest(run_id="bench", call_id="bench", judge_template=TEMPLATE, max_new_tokens=verdict_tokens,
                           items=[pb.ScoreItem(item_id=f"i{first + k}", prompt=p, response=r, reference=ref)
                                  for k, (p, r, ref) in enumerate(items)])


class Busy:
    """Intervals (start, end) on the monotonic clock during which one side was working."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def overlap_with(self, other: "Busy") -> float:
        return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in self.spans for b0, b1 in other.spans)

    @property
    def total(self) -> float:
        return sum(b - a for a, b in self.spans)


def full_step(policy, role, items, args, device: str, shards: int) -> dict:
    """Generate the step's samples in `shards` parts and score each part on the judge's thread as it lands."""
    from services.rollout.types import GenerationRequest, PromptSpec, SamplingConfig

    tok = role._tokenizer
    generated, scored = Busy(), Busy()
    done: list = []
    ready: list = []
    cv = threading.Condition()
    stream = torch.cuda.Stream() if device.startswith("cuda") else None

    def judge() -> None:
        k = 0
        while k < shards:
            with cv:
                cv.wait_for(lambda: len(ready) > k)
                part = ready[k]
            began = time.monotonic()
            if stream is not None:
                with torch.cuda.stream(stream):
                    done.append(role.score(part))
                stream.synchronize()
            else:
                done.append(role.score(part))
            scored.spans.append((began, time.monotonic()))
            k += 1

    worker = threading.Thread(target=judge)
    step_began = time.monotonic()
    worker.start()
    size = -(-len(items) // shards)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.response_tokens)
    for s in range(shards):
        part = items[s * size:(s + 1) * size]
        prompts = tuple(PromptSpec(f"g{s}-{k}", tuple(tok.encode(p, add_special_tokens=False)), s * size + k)
                        for k, (p, _, _) in enumerate(part))
        began = time.monotonic()
        samples = policy.generate(GenerationRequest(prompts=prompts, sampling=sampling))
        synchronize(device)
        generated.spans.append((began, time.monotonic()))
        responses = [(p, tok.decode(g.token_ids, skip_special_tokens=True), ref)
                     for (p, _, ref), g in zip(part, samples)]
        with cv:
            ready.append(score_request(responses, args.verdict_tokens, s * size))
            cv.notify()
    worker.join()
    return {"seconds": time.monotonic() - step_began, "generate_seconds": generated.total,
            "score_seconds": scored.total, "scorer_busy_overlap": scored.overlap_with(generated) / max(scored.total, 1e-9),
            "scored": sum(len(r.results) for r in done)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="Tiny shape on CPU: a smoke test, not a measurement.")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--responses", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=1024)
    p.add_argument("--verdict-tokens", type=int, default=32)
    p.add_argument("--baseline-items", type=int, default=8)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.small:
        args.shape, args.responses, args.response_tokens, args.verdict_tokens = "tiny", 8, 48, 4
        args.baseline_items, args.shards, args.reps, args.device = 2, 2, 1, "cpu"
    device = args.device
    torch.set_grad_enabled(False)
    from services.rollout.scorer.role import ScorerRole

    context = args.response_tokens + 256 + args.verdict_tokens  # template, prompt, reference, verdict
    with tempfile.TemporaryDirectory() as tmp:
        judge_dir, policy_dir = Path(tmp) / "judge", Path(tmp) / "policy"
        counts = write_model(args.shape, judge_dir, 0, context)
        write_model(args.shape, policy_dir, 1, context)
        judge = engine(judge_dir, device, args.responses, context)
        role = ScorerRole(judge, "torch")
        items = texts(args.responses, args.response_tokens, 0)
        request = score_request(items, args.verdict_tokens)
        prompt_tokens = sum(len(role._encode(TEMPLATE.replace("{prompt}", a).replace("{response}", b)
                                             .replace("{reference}", c))) for a, b, c in items)
        role.score(request)  # warm-up: kernels, KV pool, graphs
        synchronize(device)
        began = time.perf_counter()
        for _ in range(args.reps):
            response = role.score(request)
        synchronize(device)
        call_s = (time.perf_counter() - began) / args.reps
        assert len(response.results) == args.responses
        began = time.perf_counter()
        for k in range(args.baseline_items):
            role.score(score_request(items[k:k + 1], args.verdict_tokens, k))
        synchronize(device)
        baseline_rate = args.baseline_items / (time.perf_counter() - began)

        tflops = gemm_tflops(device, 256 if args.small else 8192)
        bandwidth = copy_bandwidth_gbs(device, (1 << 24) if args.small else (4 << 30))
        cfg = SHAPES[args.shape]
        attention = sum(2 * n * n for n in [prompt_tokens // args.responses] * args.responses) * \
            cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
        prefill_flops = 2 * counts["non_embedding_parameters"] * prompt_tokens + attention
        limit_s = prefill_flops / (tflops * 1e12) + args.verdict_tokens * counts["weight_bytes"] / (bandwidth * 1e9)

        policy = engine(policy_dir, device, args.responses, context)
        one = full_step(policy, role, items, args, device, shards=1)
        sharded = full_step(policy, role, items, args, device, shards=args.shards)
    rate = args.responses / call_s
    result = {
        "bench": "judge", "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor()
        or "cpu", "torch": torch.__version__, "shape": args.shape, "small": args.small, **counts,
        "responses": args.responses, "response_tokens": args.response_tokens, "verdict_tokens": args.verdict_tokens,
        "prompt_tokens_per_call": prompt_tokens,
        "scored_samples_per_s": round(rate, 3), "score_call_seconds": round(call_s, 4),
        "baseline_samples_per_s": round(baseline_rate, 3), "speedup_over_baseline": round(rate / baseline_rate, 3),
        "gemm_tflops": round(tflops, 2), "copy_gb_per_s": round(bandwidth, 1),
        "limit_samples_per_s": round(args.responses / limit_s, 3),
        "fraction_of_limit": round(rate / (args.responses / limit_s), 4),
        "step_seconds_score_after_generation": round(one["seconds"], 3),
        "step_seconds_score_per_shard": round(sharded["seconds"], 3), "shards": args.shards,
        "scorer_busy_overlap": round(sharded["scorer_busy_overlap"], 4),
        "scorer_busy_overlap_one_shard": round(one["scorer_busy_overlap"], 4),
        "generate_seconds": round(sharded["generate_seconds"], 3), "score_seconds": round(sharded["score_seconds"], 3),
    }
    assert one["scored"] == sharded["scored"] == args.responses
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
