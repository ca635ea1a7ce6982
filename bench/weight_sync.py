"""Weight sync trainer -> rollout: GB/s over loopback gRPC between real processes, against the copy limits.

Prints one JSON object (and writes it to --out).

For each model shape (Qwen3 dimensions of bench/train.py SHAPES, Qwen3 vocabulary, random init, bf16):
- a real trainer service (`python -m services.trainer`) and a real rollout service (`python -m
  services.rollout`, torch engine) run as separate processes on loopback;
- a caller process that holds only the coordinator's clients drives `--warmup` rounds (reported apart as
  first_rounds_s: they allocate the pinned and staging memory later rounds reuse, as a run's first sync
  does) and then `--reps` reps. Each rep configures a
  new run on the trainer, and before every timed call the replica is reloaded as a stale version, so every
  timed call moves a version the replica does not hold and applies it in full (checks, finite check, copy),
  as a step's sync does:
  - sync: SyncWeights (the coordinator's own call): the replica streams GetWeights from the trainer, which
    first cuts the new version into host memory (pinned on a GPU) and hashes its chunks on a thread pool
    as it streams; the replica hashes, stages (its kept staging memory) and checks every chunk on its own
    pool as they arrive, then applies the verified whole;
  - sync_kept: the same version to a (reloaded) replica again: the trainer's kept version, no hashing;
  - shared_path: WriteWeights (safetensors under the shared directory) then LoadWeights (read, digest
    recomputed, applied); `write`, `load` and their sum.
  Reported: median seconds, GB/s of the weight bytes, the caller's peak RSS (VmHWM) before and after;
- stream: this process reads GetWeights from the trainer (kept version; nothing done with the chunks);
  receive: the same into a WeightStreamAssembler as SyncWeights uses it (raw chunks, every check, the
  finite check included, no apply);
- limits measured in the same run over the same byte count: memcpy_host (torch copy_ of a byte tensor
  into memory already written; memcpy_device too with --device cuda), file_copy (the bytes written once
  into a new file in the shared directory and read once back: the floor of any shared-path transfer),
  loopback TCP (one process, a sender thread, sendall / recv_into of preallocated buffers), loopback
  gRPC (grpc.aio between two processes streaming pre-built 4 MiB messages: alone, and with the one sha256
  pass per byte a replica must make on a helper thread) and one sha256 pass, on one thread and on every
  core (each side hashes each byte once: a chunk is one digest block);
- against_limits and targets: sync over the gRPC ceiling, the shared path over the file copy and over
  the host memcpy; whether sync reaches 1 GB/s and the shared path half of each copy rate;
- the load average before and after each shape (the host may be shared).

`--device cuda`: the trainer and the rollout engine run on the same GPU (separate processes); the weights
still cross loopback gRPC through host memory.
A shape that does not fit the host is built with fewer decoder layers (`--layers qwen3-4b=6`; reported as
`layers` next to `full_layers`): the embedding and every layer keep the shape's real dimensions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9


def peak_rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def timed_s(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def rate(nbytes: int, seconds: list[float]) -> dict:
    median = statistics.median(seconds)
    return {"seconds": [round(s, 4) for s in seconds], "median_s": round(median, 4),
            "gb_per_s": round(nbytes / median / GB, 3)}


# ------------------------------------------------------------------ limits --

def memcpy_limit(nbytes: int, device: str, reps: int) -> dict:
    """torch copy_ of a byte tensor into memory already written (no first-touch page faults): on `device`."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()

    copy()
    return rate(nbytes, timed_s(copy, reps))


FILE_PIECE = 64 * 1024 * 1024


def file_copy_limit(nbytes: int, directory: Path, reps: int) -> dict:
    """The floor of any shared-path transfer: the bytes written once into a new file in the shared
    directory (plain writes of 64 MiB pieces, closed) and read once back (readinto a buffer already
    written). `write`, `read` and their sum (the `gb_per_s` of the whole)."""
    directory.mkdir(parents=True, exist_ok=True)
    src = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    dst = memoryview(bytearray(len(src)))
    path = directory / "file_copy_limit.bin"
    write_s, read_s = [], []
    for rep in range(reps + 1):
        path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for i in range(0, len(src), FILE_PIECE):
                f.write(src[i:i + FILE_PIECE])
        t1 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(dst):
                got += f.readinto(dst[got:got + FILE_PIECE])
        t2 = time.perf_counter()
        if rep:  # the first is a warm-up
            write_s.append(t1 - t0)
            read_s.append(t2 - t1)
    path.unlink(missing_ok=True)
    return {**rate(len(src), [w + r for w, r in zip(write_s, read_s)]), "write": rate(len(src), write_s),
            "read": rate(len(src), read_s)}


def loopback_tcp_limit(nbytes: int, reps: int) -> dict:
    """One TCP connection over 127.0.0.1; sendall and recv_into release the GIL, so sender and receiver
    threads run in parallel. Buffers are preallocated: this is the kernel's loopback copy rate."""
    src = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    dst = memoryview(bytearray(len(src)))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sender = socket.create_connection(("127.0.0.1", port))
    receiver, _ = server.accept()

    def once() -> None:
        thread = threading.Thread(target=sender.sendall, args=(src,))
        thread.start()
        got = 0
        while got < len(dst):
            got += receiver.recv_into(dst[got:], len(dst) - got)
        thread.join()

    try:
        once()
        return rate(len(src), timed_s(once, reps))
    finally:
        for s in (sender, receiver, server):
            s.close()


GRPC_LIMIT_PAYLOAD = 4 * 1024 * 1024


def _grpc_limit_server(port_queue, nbytes: int) -> None:
    """Streams `nbytes` as pre-built 4 MiB messages (no serializer: bytes as they are) to each call."""
    import asyncio

    import grpc

    from services.common.grpc.options import grpc_options

    async def serve() -> None:
        payloads = [os.urandom(GRPC_LIMIT_PAYLOAD) for _ in range(4)]

        async def stream(request, context):
            for i in range(nbytes // GRPC_LIMIT_PAYLOAD):
                yield payloads[i % 4]

        server = grpc.aio.server(options=grpc_options())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Limit", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_loopback_limit(nbytes: int, reps: int) -> dict:
    """grpc.aio between two processes on loopback, nothing but the messages: a server streaming pre-built
    4 MiB bytes messages, a client here receiving them; `with_sha256`: the client also hashes each message
    once on a helper thread, as a replica must. The ceiling of a verified gRPC sync on this host."""
    import asyncio
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from services.common.grpc.options import grpc_options

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_grpc_limit_server, args=(ports, nbytes), daemon=True)
    server.start()
    port = ports.get(timeout=120)

    async def receive(hash_each: bool) -> int:
        got, hashes = 0, []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as channel:
            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(max_workers=1) as hasher:
                async for message in channel.unary_stream("/bench.Limit/Stream")(b""):
                    got += len(message)
                    if hash_each:
                        hashes.append(loop.run_in_executor(hasher, lambda m=message: hashlib.sha256(m).digest()))
                        if len(hashes) > 8:
                            await hashes.pop(0)
                await asyncio.gather(*hashes)
        return got

    try:
        out = {}
        for name, hash_each in (("messages_only", False), ("with_sha256", True)):
            sent = asyncio.run(receive(hash_each))
            out[name] = rate(sent, timed_s(lambda h=hash_each: asyncio.run(receive(h)), reps))
        return out
    finally:
        server.kill()
        server.join()


def sha256_limit(nbytes: int, reps: int, threads: int = 1) -> dict:
    """One sha256 pass over the bytes in 4 MiB blocks (a chunk is one digest block), on `threads` threads."""
    from concurrent.futures import ThreadPoolExecutor

    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    blocks = [data[i:i + GRPC_LIMIT_PAYLOAD] for i in range(0, len(data), GRPC_LIMIT_PAYLOAD)]
    with ThreadPoolExecutor(threads) as pool:
        return rate(len(data), timed_s(lambda: list(pool.map(lambda b: hashlib.sha256(b).digest(), blocks)), reps))


# ---------------------------------------------------------------- services --

def write_model(shape: str, layers: int, directory: Path, seed: int) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    from bench.train import SHAPES, VOCAB
    from recipes.tiny_model import TinyQwen3Config, qwen3_config, save_model_dir

    dims = {k: v for k, v in SHAPES[shape].items() if k != "num_hidden_layers"}
    cfg = TinyQwen3Config(num_hidden_layers=layers, max_position_embeddings=4096, **dims)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(qwen3_config(cfg, VOCAB))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        for p in model.parameters():
            p.data.normal_(0.0, 0.02)
    save_model_dir(model, directory)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"params": params, "layers": layers, "full_layers": SHAPES[shape]["num_hidden_layers"]}


class Services:
    """A trainer and one rollout replica as real processes on loopback, sharing one token file."""

    def __init__(self, workdir: Path, device: str, num_threads: int) -> None:
        from services.common.auth import TOKEN_FILE_ENV, read_token_file, write_token_file
        from services.common.process.ports import free_port
        from services.local_stack import ServiceProcess, service_env

        token_file = write_token_file(workdir / "auth_token")
        self.token = read_token_file(token_file)
        self.trainer_address = f"127.0.0.1:{free_port()}"
        self.rollout_address = f"127.0.0.1:{free_port()}"
        env = service_env({**os.environ, TOKEN_FILE_ENV: str(token_file)})
        roots, threads = str(workdir.resolve()), str(num_threads)
        self.processes = [
            ServiceProcess("trainer", [sys.executable, "-m", "services.trainer", "--grpc-port",
                                       self.trainer_address.rsplit(":", 1)[1], "--metrics-port", "0",
                                       "--device", device, "--num-threads", threads,
                                       "--model-roots", roots, "--checkpoint-roots", roots],
                           env, workdir / "logs" / "trainer.log"),
            ServiceProcess("rollout", [sys.executable, "-m", "services.rollout", "--grpc-port",
                                       self.rollout_address.rsplit(":", 1)[1], "--metrics-port", "0",
                                       "--num-threads", threads, "--model-roots", roots,
                                       "--sglang-weights-dir", str(workdir / "sglang-weights"),
                                       "--weight-sources", self.trainer_address],
                           env, workdir / "logs" / "rollout.log"),
        ]

    def __enter__(self) -> "Services":
        for p in self.processes:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.processes):
            p.stop()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        import grpc

        from proto import lockstep_pb2 as pb
        from proto import lockstep_pb2_grpc as pb_grpc
        from services.common.grpc.options import sync_channel

        deadline = time.monotonic() + timeout_s
        for address, stub in ((self.trainer_address, pb_grpc.TrainerStub), (self.rollout_address, pb_grpc.RolloutStub)):
            channel = sync_channel(address, self.token)
            try:
                while True:
                    for p in self.processes:
                        if not p.alive():
                            raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
                    try:
                        stub(channel).Health(pb.HealthRequest(), timeout=5)
                        break
                    except grpc.RpcError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
            finally:
                channel.close()

    def read_stream(self, run_id: str, take) -> float:
        """Seconds to read the trainer's whole GetWeights stream here, handing each chunk (as encoded, the
        way SyncWeights reads it) to `take`."""
        from proto import lockstep_pb2 as pb
        from services.common.grpc.options import sync_channel
        from services.rollout.server import GET_WEIGHTS_METHOD

        channel = sync_channel(self.trainer_address, self.token)
        try:
            call = channel.unary_stream(GET_WEIGHTS_METHOD, request_serializer=pb.GetWeightsRequest.SerializeToString,
                                        response_deserializer=None)
            t0 = time.perf_counter()
            for raw in call(pb.GetWeightsRequest(run_id=run_id), timeout=1800):
                take(raw)
            return time.perf_counter() - t0
        finally:
            channel.close()


STALE_VERSION = 1_000_000  # what the replica is (re)loaded as before each timed sync: version 0 is then new to it


def run_caller(args: argparse.Namespace) -> None:
    """The coordinator's side of a sync, in a process that holds nothing else. Each rep re-sends the run's
    ConfigureRun (the trainer keeps the run's state and lets go of the chunks it kept, as a step does) and,
    before every timed call, reloads the replica as a stale version, so each timed call moves and applies a
    version the replica does not hold (what a step's sync does): `sync` (SyncWeights; the trainer cuts and
    hashes its chunks as it streams),
    `sync_kept` (SyncWeights of the same version again: the trainer's kept chunks, as for a second replica)
    and the shared path (WriteWeights, then LoadWeights)."""
    import asyncio
    import shutil

    from services.common.auth import read_token_file
    from services.coordinator.clients import RolloutClient, TrainerClient

    async def sync() -> dict:
        token = read_token_file(args.token_file)
        client = RolloutClient(args.rollout, timeout_s=1800, token=token)
        trainer = TrainerClient(args.trainer, timeout_s=1800, token=token)

        async def stale_replica(run_id: str) -> None:
            await client.load_model(run_id, args.model_path, STALE_VERSION, json.dumps(
                {"engine": "torch", "dtype": "bfloat16", "device": args.device}))

        async def timed_sync(run_id: str) -> tuple[float, object]:
            await stale_replica(run_id)
            t0 = time.perf_counter()
            got = await client.sync_weights(run_id, 0, args.trainer)
            return time.perf_counter() - t0, got

        before = peak_rss_bytes()
        seconds, kept_seconds, write_s, load_s, got = [], [], [], [], None
        run_id = args.run_id
        for _ in range(args.warmup + args.reps):
            await trainer.configure(run_id, args.model_path, 0, json.dumps({"dtype": "bfloat16"}))
            took, got = await timed_sync(run_id)
            seconds.append(took)
            took, again = await timed_sync(run_id)
            kept_seconds.append(took)
            assert again.total_sha256 == got.total_sha256
        after_grpc = peak_rss_bytes()
        for rep in range(args.warmup + args.reps):
            directory = Path(args.weights_dir) / f"rep{rep}"
            await stale_replica(run_id)
            t0 = time.perf_counter()
            written = await trainer.write_weights(run_id, str(directory))
            t1 = time.perf_counter()
            loaded = await client.load_weights(run_id, 0, written.directory, written.total_sha256)
            write_s.append(t1 - t0)
            load_s.append(time.perf_counter() - t1)
            assert loaded.total_sha256 == written.total_sha256 == got.total_sha256
            shutil.rmtree(directory)
        return {"seconds": seconds, "kept_seconds": kept_seconds, "bytes": got.bytes, "tensors": got.tensors,
                "digest": got.total_sha256,
                "peak_rss_before": before, "peak_rss_after_grpc": after_grpc, "peak_rss_after": peak_rss_bytes(),
                "shared_path_write_s": write_s, "shared_path_load_s": load_s}

    print(json.dumps(asyncio.run(sync())))


def measure_shape(shape: str, layers: int, args: argparse.Namespace) -> dict:
    from services.common.weights.stream import WeightStreamAssembler
    from services.rollout.weights.staging_arena import StagingArena

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        workdir = Path(tmp)
        counts = write_model(shape, layers, workdir / "model", args.seed)
        with Services(workdir, args.device, args.num_threads) as services:
            services.wait_ready()
            run_id = f"bench-{shape}"
            caller = subprocess.run(
                [sys.executable, __file__, "--caller", "--rollout", services.rollout_address, "--trainer",
                 services.trainer_address, "--run-id", run_id, "--token-file", str(workdir / "auth_token"),
                 "--reps", str(args.reps), "--warmup", str(args.warmup), "--weights-dir", str(workdir / "weights"),
                 "--model-path", str(workdir / "model"), "--device", args.device], capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")) if p)})
            if caller.returncode != 0:
                logs = "\n".join(f"--- {p.name}:\n{p.tail()}" for p in services.processes)
                raise RuntimeError(f"the caller failed ({caller.returncode}):\n{caller.stderr[-4000:]}\n{logs}")
            sync = json.loads(caller.stdout.strip().splitlines()[-1])
            nbytes = sync["bytes"]
            # The first rounds allocate what later ones reuse (pinned host buffers on both sides, the
            # replica's staging memory): reported apart, left out of the medians.
            first = {k: [round(x, 4) for x in sync[k][:args.warmup]]
                     for k in ("seconds", "kept_seconds", "shared_path_write_s", "shared_path_load_s")}
            for k in first:
                sync[k] = sync[k][args.warmup:]
            stream_seconds, receive_seconds = [], []
            staging = StagingArena(pin_memory=False)  # kept between reps, as SyncWeights keeps its own
            for rep in range(args.reps + 2):
                nothing_kept = services.read_stream(run_id, lambda chunk: None)
                with staging.lease() as lease:
                    assembler = WeightStreamAssembler(check_finite=True, allocate=lease.allocate)
                    received = services.read_stream(run_id, assembler.add_raw)
                    assembler.finish()
                    assert assembler.total_sha256 == sync["digest"]
                    del assembler
                if rep >= 2:  # the first sized the staging memory, the second wrote its pages first
                    stream_seconds.append(nothing_kept)
                    receive_seconds.append(received)
        # Measured after the services stopped, over the same byte count; the file copy in the directory
        # the shared path wrote to.
        threads = os.cpu_count() or 1
        limits = {"memcpy_host": memcpy_limit(nbytes, "cpu", args.reps),
                  "file_copy": file_copy_limit(nbytes, workdir / "weights", args.reps),
                  "loopback_tcp": loopback_tcp_limit(nbytes, args.reps),
                  "grpc_loopback": grpc_loopback_limit(nbytes, args.reps),
                  "sha256": sha256_limit(nbytes, args.reps),
                  f"sha256_{threads}_threads": sha256_limit(nbytes, args.reps, threads)}
        if args.device != "cpu":
            limits["memcpy_device"] = memcpy_limit(nbytes, args.device, args.reps)
    sync_rate = rate(nbytes, sync["seconds"])
    shared = rate(nbytes, [w + r for w, r in zip(sync["shared_path_write_s"], sync["shared_path_load_s"])])
    return {
        "shape": shape, **counts, "bytes": nbytes, "tensors": sync["tensors"], "digest": sync["digest"],
        "sync": sync_rate,
        "sync_kept": rate(nbytes, sync["kept_seconds"]),
        "first_rounds_s": {"sync": first["seconds"], "sync_kept": first["kept_seconds"],
                           "shared_path_write": first["shared_path_write_s"],
                           "shared_path_load": first["shared_path_load_s"]},
        "caller_peak_rss_growth_bytes": sync["peak_rss_after_grpc"] - sync["peak_rss_before"],
        "shared_path": {**shared,
                        "write": rate(nbytes, sync["shared_path_write_s"]),
                        "load": rate(nbytes, sync["shared_path_load_s"])},
        "caller_peak_rss_growth_with_shared_path_bytes": sync["peak_rss_after"] - sync["peak_rss_before"],
        "caller_peak_rss_bytes": sync["peak_rss_after"],
        "stream": rate(nbytes, stream_seconds),
        "receive": rate(nbytes, receive_seconds),
        "limits": limits,
        "against_limits": {
            "sync_over_grpc_messages_only": round(sync_rate["gb_per_s"] / limits["grpc_loopback"]["messages_only"]["gb_per_s"], 3),
            "shared_path_over_file_copy": round(shared["gb_per_s"] / limits["file_copy"]["gb_per_s"], 3),
            "shared_path_over_memcpy_host": round(shared["gb_per_s"] / limits["memcpy_host"]["gb_per_s"], 3),
        },
        "targets": {"sync_at_least_1_gb_per_s": sync_rate["gb_per_s"] >= 1.0,
                    "shared_path_at_least_half_the_file_copy": shared["gb_per_s"] >= 0.5 * limits["file_copy"]["gb_per_s"],
                    "shared_path_at_least_half_the_host_memcpy":
                        shared["gb_per_s"] >= 0.5 * limits["memcpy_host"]["gb_per_s"]},
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
    }


def versions(device: str) -> dict:
    import grpc
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "grpcio": grpc.__version__,
           "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count()}
    try:
        out["cpu_model"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                                if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device != "cpu":
        out["device"] = torch.cuda.get_device_name(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b", help="comma-separated keys of bench/train.py SHAPES")
    ap.add_argument("--layers", default="",
                    help="comma-separated shape=N: build that shape with only N decoder layers (one that does not "
                    "fit the host); other shapes are full")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (trainer and rollout engine on the same GPU)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="leading rounds of each source reported as first_rounds_s and left out of the medians "
                    "(they allocate the pinned and staging memory later rounds reuse)")
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads per service (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", default=None, help="directory for the model files (default: the system's)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--note", default="", help="free text recorded in the JSON (e.g. why a shape is truncated)")
    ap.add_argument("--caller", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rollout", help=argparse.SUPPRESS)
    ap.add_argument("--trainer", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--weights-dir", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.caller:
        run_caller(args)
        return
    from bench.train import SHAPES  # imports torch: not in the caller, whose peak RSS is measured

    layers = {k: int(v) for k, v in (item.split("=", 1) for item in args.layers.split(",") if item)}
    unknown = sorted(set(layers) - set(SHAPES)) + sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
    report = {
        "benchmark": "weight_sync",
        "sources": {"sync": "grpc loopback (SyncWeights: the replica pulls GetWeights), a version new to the replica",
                    "sync_kept": "the same version to a replica again: the trainer's kept chunks",
                    "shared_path": "WriteWeights + LoadWeights through a directory both services see"},
        "device": args.device, "reps": args.reps, "statistic": "median wall seconds; gb_per_s = bytes / median / 1e9",
        "versions": versions(args.device), "note": args.note, "results": [],
    }
    for shape in args.shapes.split(","):
        report["results"].append(measure_shape(shape, layers.get(shape, SHAPES[shape]["num_hidden_layers"]), args))
        text = json.dumps(report, indent=1)
        if args.out:  # after every shape: a later shape that fails leaves the earlier ones written
            Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
