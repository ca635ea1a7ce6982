"""Run `worker(rank, world, init_file, out_dir)` in `world` forked processes and require each to exit 0: the
CPU tests' way of forming a real gloo group of several ranks (the init file is out_dir/init)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def run_forked_ranks(worker: Callable[[int, int, str, str], None], world: int, out_dir: Path,
                     timeout_s: float = 120.0) -> None:
    if dist.is_initialized():
        # A Trainer earlier in this process formed a world-of-one group. Leave it here, before the fork:
        # a child cannot shut down a group whose threads it did not inherit (it waits for them forever).
        dist.destroy_process_group()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker, args=(r, world, str(out_dir / "init"), str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:  # a hung rank must not outlive the test (it would hold CPU for the rest of the session)
        p.kill()
        p.join()
    assert not hung and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
