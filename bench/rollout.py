"""Embedded-engine decode throughput and the training step, `fast` vs `true_on_policy`, through the real services.

One JSON on stdout (and --out): for each numerics mode, the rollout service (`python -m services.rollout`,
torch engine) generates `prompts x samples` sequences of exactly `new_tokens` new tokens (no stop token),
then the trainer service (`python -m services.trainer`) trains on them over gRPC: step 1's parity
statistics (rollout log-probs against the trainer's recompute) and the wall time of each step.

Ratios in the same run:
- `decode_roofline_fraction`: the HBM time of one decode step (every weight read once, plus the KV cache
  of every live row read once: the bytes a step cannot avoid), over the measured time per decode step,
  with the HBM bandwidth measured here by a device-to-device copy (`hbm_copy_gb_per_s`).
- `true_on_policy_cost`: true_on_policy's rollout seconds and steady train-step seconds over fast's.

The model is a random-init Qwen3 shape whose lm_head is scaled so the next-token entropy of the prompts
is about `--entropy` nats (a random init is near uniform over 151936 tokens otherwise, which no
trained policy is; the scale is found by bisection on the prompts before the services start).

    python3 bench/rollout.py --out bench/results/rollout_h200.json          # the H200 run
    python3 bench/rollout.py --shape tiny --device cpu --prompts 4 --samples 2 --new-tokens 8   # smoke

`--workload longtail` runs bench/rollout_longtail.py instead (in process, no services): static vs
continuous scheduling of long-tailed sequences over the paged KV pool (see that module).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       # Untied (the real 0.6B ties them) so scaling the lm_head leaves the embeddings alone.
                       tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layers at 6 of its 48 (issue 40's reduced depth: fp32 masters and AdamW fit one GPU).
    "qwen3-30b-a3b-6l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=6, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=True),
    "tiny-moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}


def write_model(shape: str, directory: Path, *, device: str, seed: int, prompts: list[list[int]],
                entropy: float) -> dict:
    """Save the model (bf16) with its lm_head scaled to the target entropy; what was built."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = "num_experts" in SHAPES[shape]
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    cfg = config_cls(max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(cfg).to(torch.bfloat16).eval()
    ids = torch.tensor(prompts[:8], device=device)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, -16:].float()
        head = model.get_output_embeddings().weight.float()

        def mean_entropy(scale: float) -> float:
            logp = torch.log_softmax(hidden @ (head * scale).T, dim=-1)
            return float(-(logp.exp() * logp).sum(-1).mean())

        lo, hi = 1.0, 1000.0
        for _ in range(30):  # entropy falls as the scale grows
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if mean_entropy(mid) > entropy else (lo, mid)
        scale = math.sqrt(lo * hi)
        reached = mean_entropy(scale)
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(str(directory))
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"params": params, "weight_bytes": weight_bytes, "lm_head_scale": round(scale, 3),
           "prompt_entropy_nats": round(reached, 3)}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def hbm_copy_gb_per_s(device: str) -> float:
    """Device-to-device copy rate (read + write bytes per second), the bandwidth a decode step can use."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / seconds / 1e9


def kv_bytes_per_token(shape: str) -> int:
    s = SHAPES[shape]
    return s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * 2  # K and V, bf16


class Services:
    """A trainer and a rollout service as real processes on loopback, with a token file."""

    def __init__(self, work: Path, device: str) -> None:
        from services.common.auth import TOKEN_FILE_ENV, read_token_file, write_token_file
        from services.common.process.ports import free_port

        self.work = work
        token_file = work / "auth_token"
        write_token_file(token_file)
        self.token = read_token_file(token_file)
        env = {**os.environ, TOKEN_FILE_ENV: str(token_file), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
        self.trainer_port, self.rollout_port = free_port(), free_port()
        roots = str(work)
        common = ["--num-threads", "8", "--model-roots", roots]
        self.procs = []
        for name, args in (
            ("trainer", ["-m", "services.trainer", "--grpc-port", str(self.trainer_port), "--metrics-port",
                         str(free_port()), "--device", device, "--checkpoint-roots", roots, *common]),
            ("rollout", ["-m", "services.rollout", "--grpc-port", str(self.rollout_port), "--metrics-port",
                         str(free_port()), "--weight-sources", f"127.0.0.1:{self.trainer_port}", *common]),
        ):
            log = open(work / f"{name}.log", "ab")
            self.procs.append((name, subprocess.Popen([sys.executable, *args], env=env, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True)))
            log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n" + (self.work / f"{n}.log").read_text(errors="replace")[-3000:]
                         for n, _ in self.procs)

    def close(self) -> None:
        for _, p in self.procs:
            p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


async def wait_ready(client, deadline_s: float = 300.0) -> None:
    t0 = time.monotonic()
    while True:
        try:
            await client.health()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() - t0 > deadline_s:
                raise
            await asyncio.sleep(1.0)


async def bench_mode(mode: str, services: Services, model_dir: Path, args, prompts: list[list[int]]) -> dict:
    from proto import lockstep_pb2 as pb
    from services.common.tensors import from_proto, ids_to_proto
    from services.coordinator.clients import RolloutClient, TrainerClient

    rollout = RolloutClient(f"127.0.0.1:{services.rollout_port}", 3600, services.token)
    trainer = TrainerClient(f"127.0.0.1:{services.trainer_port}", 3600, services.token)
    await wait_ready(rollout)
    await wait_ready(trainer)
    run_id = f"bench-{mode}"
    # A fixed cache capacity: the warm-up call and the timed one share one cache and its captured graphs.
    engine = {"device": args.device, "dtype": "bfloat16", "numerics": mode,
              "max_batch_size": args.prompts * args.samples, "max_context_tokens": args.prompt_len + args.new_tokens}
    await rollout.load_model(run_id, str(model_dir), 0, json.dumps(engine))
    sampling = pb.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens)

    def request(n_prompts: int, new_tokens: int, seed: int) -> pb.GenerateRequest:
        s = pb.SamplingParams()
        s.CopyFrom(sampling)
        s.max_new_tokens = new_tokens
        return pb.GenerateRequest(
            run_id=run_id, step=1, policy_version=0, samples_per_prompt=args.samples, sampling=s,
            prompts=[pb.Prompt(group_id=f"g{i}", token_ids=ids_to_proto(p), seed=seed + 1000 * i)
                     for i, p in enumerate(prompts[:n_prompts])])

    await rollout.generate(request(args.prompts, 4, 7))  # kernels compiled, graphs captured
    t0 = time.perf_counter()
    response = await rollout.generate(request(args.prompts, args.new_tokens, 1))
    rollout_s = time.perf_counter() - t0
    new_tokens = sum(from_proto(s.response_token_ids, field="response_token_ids").numel()
                     for s in response.samples)

    gate = {} if mode == "true_on_policy" else {
        "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9}}
    trainer_cfg = {"lr": 1e-6, "dtype": "bfloat16", "microbatch_tokens": args.microbatch_tokens,
                   "numerics": mode, **gate}
    await trainer.configure(run_id, str(model_dir), 0, json.dumps(trainer_cfg))
    step_s, metrics = [], []
    for step in range(1, args.train_steps + 1):
        trajectories = [
            pb.Trajectory(run_id=run_id, step=step, policy_version=step - 1, group_id=s.group_id,
                          sample_id=s.sample_id, prompt_token_ids=ids_to_proto(prompts[int(s.group_id[1:])]),
                          response_token_ids=s.response_token_ids, rollout_logprobs=s.logprobs,
                          reward=float(s.index % 2), advantage=1.0 if s.index % 2 else -1.0,
                          finish_reason=s.finish_reason,
                          # MoE: the experts the rollout read each token through (routing agreement).
                          **({"routed_experts": s.routed_experts} if s.HasField("routed_experts") else {}))
            for s in response.samples]
        header = pb.TrainStepHeader(run_id=run_id, step=step, policy_version=step - 1,
                                    num_trajectories=len(trajectories))
        t0 = time.perf_counter()
        out = await trainer.train_step(header, trajectories)
        step_s.append(time.perf_counter() - t0)
        metrics.append(dict(out.metrics))
    await rollout.close()
    await trainer.close()
    first = metrics[0]
    return {
        "mode": mode,
        "sequences": len(response.samples), "new_tokens": new_tokens,
        "rollout_seconds": round(rollout_s, 3), "new_tokens_per_second": round(new_tokens / rollout_s, 1),
        "seconds_per_decode_step": rollout_s / args.new_tokens,
        "train_step_seconds": [round(t, 3) for t in step_s],
        "steady_train_step_seconds": round(statistics.median(step_s[1:] or step_s), 3),
        "step1": {k: first[k] for k in ("iw_mean", "iw_min", "iw_max", "logprob_abs_diff_mean",
                                        "logprob_abs_diff_max", "entropy", "tokens_response",
                                        "moe_routing_agreement_min", "moe_expert_load_max") if k in first},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b",
                    help=f"fixed workload: one of {sorted(SHAPES)}; longtail: rollout_longtail.LONGTAIL_SHAPES "
                    "(adds qwen3-30b-a3b and tiny-moe)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (sequences = prompts x samples)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--entropy", type=float, default=3.3, help="target next-token entropy of the prompts (nats)")
    ap.add_argument("--modes", default="fast,true_on_policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--workload", default="fixed", choices=("fixed", "longtail"),
                    help="fixed: --new-tokens per sequence through the services; longtail: rollout_longtail.py")
    lt = ap.add_argument_group("longtail")
    lt.add_argument("--cap", type=int, default=8192, help="max new tokens per sequence")
    lt.add_argument("--stop-tokens", type=int, default=76, help="stop ids (mean length ~ vocab / this)")
    lt.add_argument("--static-rows", type=int, default=64, help="rows of a static batch (today's default)")
    lt.add_argument("--continuous-rows", type=int, default=256)
    lt.add_argument("--schedulers", default="static,continuous", help="which schedulers to run (comma-separated)")
    lt.add_argument("--pool-tokens", type=int, default=None, help="continuous KV pool (default: the static batch's dense KV, static rows x (prompt + cap))")
    lt.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens")
    lt.add_argument("--big-shape", default="qwen3-4b", help="'' to skip the large-shape run")
    lt.add_argument("--big-cap", type=int, default=14000)
    lt.add_argument("--big-stop-tokens", type=int, default=72)
    lt.add_argument("--big-kv-gb", type=float, default=60.0)
    lt.add_argument("--only-big", action="store_true", help="run the large shape alone")
    args = ap.parse_args()
    if args.workload == "longtail":
        from bench.rollout_longtail import LONGTAIL_SHAPES, longtail

        if args.entropy == 3.3:
            args.entropy = 11.8  # near-uniform: the stop ids then set the length distribution
        if args.shape not in LONGTAIL_SHAPES:
            ap.error(f"--shape {args.shape} has no longtail model")
        text = json.dumps(longtail(args, hbm_copy_gb_per_s), indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return

    if args.shape not in SHAPES:
        ap.error(f"--shape {args.shape}: the fixed workload has {sorted(SHAPES)}")
    vocab = SHAPES[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
    result = {"benchmark": "rollout", "shape": args.shape, **SHAPES[args.shape], "device": args.device,
              "prompts": args.prompts, "samples_per_prompt": args.samples, "prompt_len": args.prompt_len,
              "max_new_tokens": args.new_tokens, "temperature": 1.0,
              "versions": {"python": sys.version.split()[0], "torch": torch.__version__}}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        result["model"] = write_model(args.shape, model_dir, device=args.device, seed=args.seed,
                                      prompts=prompts, entropy=args.entropy)
        result["hbm_copy_gb_per_s"] = round(hbm_copy_gb_per_s(args.device), 1)
        services = Services(work, args.device)
        try:
            runs = [asyncio.run(bench_mode(m, services, model_dir, args, prompts)) for m in args.modes.split(",")]
        except BaseException:
            print(services.logs(), file=sys.stderr)
            raise
        finally:
            services.close()
    # Roofline of one decode step: weights once + the live rows' KV (mean context over the decode).
    rows = args.prompts * args.samples
    mean_ctx = args.prompt_len + (args.new_tokens - 1) / 2
    step_bytes = result["model"]["weight_bytes"] + rows * mean_ctx * kv_bytes_per_token(args.shape)
    result["decode_step_bytes"] = int(step_bytes)
    hbm_s = step_bytes / (result["hbm_copy_gb_per_s"] * 1e9)
    for run in runs:
        run["decode_roofline_fraction"] = round(hbm_s / run["seconds_per_decode_step"], 4)
        run["seconds_per_decode_step"] = round(run["seconds_per_decode_step"], 5)
    result["runs"] = runs
    by = {r["mode"]: r for r in runs}
    if {"fast", "true_on_policy"} <= set(by):
        result["true_on_policy_cost"] = {
            "rollout": round(by["true_on_policy"]["rollout_seconds"] / by["fast"]["rollout_seconds"], 3),
            "train_step": round(by["true_on_policy"]["steady_train_step_seconds"]
                                / by["fast"]["steady_train_step_seconds"], 3)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
