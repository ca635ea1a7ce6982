"""Prefill work of multi-turn episodes in the embedded engine, with KV reuse across turns and without.

    PYTHONPATH=. python bench/episode_kv_reuse.py --out bench/results/episode_kv_reuse_cpu.json

The same episodes (number_guess, --turns turns, same seeds) run through TorchEngine.run_episodes twice in
one process, true_on_policy: with `episode_kv_reuse` (each turn prefills the last sampled token and the
observation on top of the kept K/V) and without (each turn prefills the episode's whole context). Reported
per mode: prefill tokens computed, prefix tokens reused, misses, median wall seconds of --repeats runs; and
whether the two modes gave the same tokens and log-prob bits. Prints one JSON object. Run from the repository root with it on the path (PYTHONPATH=.).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import struct
import tempfile
import time
from pathlib import Path



def _request(groups: int, per_group: int, turns: int, max_new_tokens: int, prompt_chars: int):
    from contract.environment import EpisodeLimits, EpisodeProblem
    from services.rollout.types import SamplingConfig
    from services.rollout.episodes.requests import EpisodeRequest
    from services.rollout.episodes.runner import EpisodeSpec

    specs = []
    for g in range(groups):
        prompt = (f"guess the hidden number from 0 to 99, one number a turn ({g}): ").ljust(prompt_chars, ".")
        for i in range(per_group):
            specs.append(EpisodeSpec(f"g{g}", i, EpisodeProblem(f"p{g}", prompt, str(17 * g % 100)), seed=100 * g + i))
    limits = EpisodeLimits(max_turns=turns, max_episode_tokens=1024, step_timeout_s=30.0)
    return EpisodeRequest("number_guess", {}, limits, tuple(specs),
                          SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens), per_group)


def _bits(episodes) -> list:
    return [(e.response_ids, [struct.pack("<f", x) for x in e.logprobs]) for e in episodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prompt-chars", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # Imported here: the environments' forkserver imports this module, and must start in well under a step's
    # timeout (torch and transformers take seconds on a busy CPU).
    import torch

    from recipes.tiny_model import TinyQwen3Config, build_model_dir
    from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig

    torch.set_num_threads(args.threads)
    model_dir = build_model_dir(Path(tempfile.mkdtemp()) / "tiny", TinyQwen3Config(max_position_embeddings=1024),
                                seed=0)
    request = _request(args.groups, args.per_group, args.turns, args.max_new_tokens, args.prompt_chars)
    modes, bits = {}, {}
    for reuse in (False, True):
        engine = TorchEngine(TorchEngineConfig(dtype="float32", numerics="true_on_policy", episode_kv_reuse=reuse))
        engine.load(str(model_dir), 0)
        walls = []
        for _ in range(args.repeats):
            engine.take_prefill_counts()
            began = time.perf_counter()
            episodes = engine.run_episodes(request)
            walls.append(time.perf_counter() - began)
            counts = engine.take_prefill_counts()
        bits[reuse] = _bits(episodes)
        modes["reuse" if reuse else "re_prefill"] = {
            "prefill_tokens": counts.prefill_tokens, "reused_prefix_tokens": counts.reused_tokens,
            "misses": counts.misses, "wall_s_median": round(statistics.median(walls), 3),
            "episodes": len(episodes), "turns_mean": round(statistics.mean(e.turns for e in episodes), 2),
            "context_tokens_mean": round(statistics.mean(e.length for e in episodes), 1),
        }
    out = {
        "bench": "episode_kv_reuse", "device": f"cpu ({platform.processor() or platform.machine()}), "
        f"{args.threads} thread(s)", "torch": torch.__version__, "model": "tiny Qwen3 (2 layers, hidden 128), fp32",
        "numerics": "true_on_policy", "task": "number_guess", "args": {k: str(v) for k, v in vars(args).items()},
        **modes,
        "prefill_tokens_ratio": round(modes["reuse"]["prefill_tokens"] / modes["re_prefill"]["prefill_tokens"], 4),
        "wall_ratio": round(modes["reuse"]["wall_s_median"] / modes["re_prefill"]["wall_s_median"], 3),
        "bitwise_equal": bits[True] == bits[False],
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
