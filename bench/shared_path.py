"""Shared-path weight source in one process: write_weight_dir, then read_weight_dir and the torch engine's
apply, against the file floor measured in the same run over the same bytes in the same directory.

Floor: the same bytes written to one file with plain 4 MiB writes, and read back with readinto into a
buffer allocated before the timer, both untouched ("fresh": the read pays the first-touch page faults a
reader of new tensors pays) and already faulted by an earlier read ("warm"). The reader is timed reading
into new tensors and into a kept staging arena (services.rollout.weights.staging_arena, as SyncWeights receives),
whose memory is faulted in after its first lease. Prints one JSON object.

    python -m bench.shared_path --shape qwen3-0.6b --reps 3 --tmp /dev/shm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

BLOCK = 4 * 1024 * 1024


def _median_rate(nbytes: int, runs: list[tuple[float, float]]) -> dict:
    """runs: (wall seconds, process CPU seconds, all threads) of each repetition."""
    median = statistics.median(w for w, _ in runs)
    return {"seconds": [round(w, 4) for w, _ in runs], "median_s": round(median, 4),
            "gb_per_s": round(nbytes / median / 1e9, 3),
            "cpu_s_per_gb": round(statistics.median(c for _, c in runs) / (nbytes / 1e9), 3)}


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return (time.perf_counter() - wall, time.process_time() - cpu), result


def _floor_once(directory: Path, views: list[memoryview], nbytes: int, warm) -> dict:
    """One repetition of the floor: write the bytes, read them into new memory, then into `warm` (memory
    already written); returns the timings and the buffer to pass as `warm` next time."""
    import torch

    path = directory / "floor.bin"

    def write() -> None:
        with open(path, "wb", buffering=0) as f:
            for view in views:
                for offset in range(0, len(view), BLOCK):
                    f.write(view[offset:offset + BLOCK])

    def read(buffer) -> None:
        target = memoryview(buffer.numpy())
        with open(path, "rb", buffering=0) as f:
            for offset in range(0, nbytes, BLOCK):
                f.readinto(target[offset:offset + BLOCK])

    out = {"write": _timed(write)[0]}
    fresh = torch.empty(nbytes, dtype=torch.uint8)
    out["read_fresh"] = _timed(lambda: read(fresh))[0]
    warm = fresh if warm is None else warm
    out["read_warm"] = _timed(lambda: read(warm))[0]
    path.unlink()
    return out, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the shape's)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="directory for the model and the weight directories")
    args = parser.parse_args()

    import torch

    from bench.train import SHAPES
    from bench.weight_sync import write_model
    from contract.engine_options import TorchEngineConfig
    from services.common.weights.files import read_weight_dir, write_weight_dir
    from services.rollout.weights.staging_arena import StagingArena
    from services.rollout.embedded.torch_engine import TorchEngine

    layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        work = Path(tmp)
        counts = write_model(args.shape, layers, work / "model", seed=0)
        engine = TorchEngine(TorchEngineConfig(dtype="bfloat16", device="cpu", max_batch_size=1))
        engine.load(str(work / "model"), 0)
        # What the trainer sends: every tensor, tied aliases once (a fresh copy, as its dtype cast makes).
        seen, tensors = set(), []
        for name, t in engine._model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                tensors.append((name, (t.detach() + 0).contiguous()))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for _, t in tensors]
        arena = StagingArena(pin_memory=False)
        runs: dict[str, list] = {}
        warm, version = None, 0
        for _ in range(args.reps):
            # The floor and each variant back to back in every repetition: the same host load for both.
            floor, warm = _floor_once(work, views, nbytes, warm)
            for key, timing in floor.items():
                runs.setdefault(f"floor_{key}", []).append(timing)
            for into_arena in (False, True):
                version += 1
                directory = work / f"v{version}"
                timing, written = _timed(lambda: write_weight_dir(directory, tensors, version, base_dir=work / "model"))
                runs.setdefault("write", []).append(timing)
                prefix = "arena_" if into_arena else ""
                with arena.lease() if into_arena else contextlib.nullcontext() as lease:
                    extra = {"allocate": lease.allocate} if into_arena else {}
                    timing, (got, files) = _timed(lambda: read_weight_dir(
                        directory, policy_version=version, expected_sha256=written.total_sha256, **extra))
                    runs.setdefault(prefix + "read", []).append(timing)
                    applied, _ = _timed(lambda: engine.update_weights_from_dir(str(directory), got, files.policy_version))
                    runs.setdefault(prefix + "apply", []).append(applied)
                    runs.setdefault(prefix + "load", []).append((timing[0] + applied[0], timing[1] + applied[1]))
                    del got
                shutil.rmtree(directory)
                # Each tensor changed (one ulp of the first value) so the next version is a real update.
                for _, t in tensors:
                    if t.numel():
                        t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.uint8)[0] += 1
        rates = {key: _median_rate(nbytes, timings) for key, timings in runs.items()}
        median = {key: rate["median_s"] for key, rate in rates.items()}
        ratios = {
            "write_to_floor": median["floor_write"] / median["write"],
            "load_to_fresh_read_floor": median["floor_read_fresh"] / median["load"],
            "round_trip_to_floor": (median["floor_write"] + median["floor_read_fresh"]) / (median["write"] + median["load"]),
        }
        ratios["arena_load_to_warm_read_floor"] = median["floor_read_warm"] / median["arena_load"]
        ratios["arena_round_trip_to_warm_floor"] = ((median["floor_write"] + median["floor_read_warm"])
                                                    / (median["write"] + median["arena_load"]))
        print(json.dumps({
            "benchmark": "shared_path", "shape": args.shape, **counts, "bytes": nbytes, "tensors": len(tensors),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__,
            "statistic": "median of --reps; cpu_s_per_gb: process CPU seconds (all threads) per GB",
            "rates": rates, "ratios": {k: round(v, 3) for k, v in ratios.items()},
        }, indent=1))


if __name__ == "__main__":
    main()
