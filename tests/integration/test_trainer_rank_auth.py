"""A trainer whose second rank is started apart from it (`--rank-rendezvous-port`, as the Ray launcher
places ranks), in real processes over real gRPC: a rank holding another token is refused at rank 0's
rendezvous, says why, and never joins; a stranger at rank 0's liveness socket is dropped; then the rank
holding the deployment's token joins and the two ranks train as one rank does."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV, BearerToken, generate_token
from services.common.process.ports import free_port
from services.common.rendezvous.store import RendezvousClient
from services.trainer.distributed.rank_rendezvous import GROUP, LIVENESS_KEY
from tests.support.trainer_steps import assert_like_one_rank, grpc_metrics, one_rank_metrics, step_chunks
from tests.trainer.trainer_support import build_tiny_model_dir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _env(token: BearerToken) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    return {**env, TOKEN_ENV: token.secret}


def test_a_rank_with_another_token_never_joins_and_the_right_one_trains(tmp_path):
    model = build_tiny_model_dir(tmp_path / "model")
    streams = step_chunks(model)
    one = one_rank_metrics(model, streams)
    token = BearerToken(generate_token())
    grpc_port, rendezvous_port = free_port(), free_port()
    rendezvous = f"127.0.0.1:{rendezvous_port}"
    log = tmp_path / "trainer.log"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "services.trainer", "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
         "--metrics-port", "0", "--num-threads", "1", "--data-parallel", "2", "--rank-rendezvous-port",
         str(rendezvous_port), "--model-roots", str(tmp_path)],
        cwd=REPO, env=_env(token), stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    rank_cmd = [sys.executable, "-m", "services.trainer.distributed.rank", "--rank", "1", "--rendezvous", rendezvous,
                "--join-timeout-s", "240"]
    rank1 = None
    try:
        # Another deployment's token: the rank waits for rank 0 to serve, is refused at its first call, and
        # exits naming why.
        intruder = subprocess.run(rank_cmd, cwd=REPO, env=_env(BearerToken(generate_token())), capture_output=True,
                                  text=True, timeout=300)
        assert intruder.returncode == 1, intruder.stderr[-3000:]
        assert "refused this rank's token" in intruder.stderr and "UNAUTHENTICATED" in intruder.stderr
        assert trainer.poll() is None, log.read_text()[-3000:]  # rank 0 waits on for its rank 1

        # What the store holds, read as a rank does (with the token): the intruder wrote nothing.
        client = RendezvousClient(rendezvous, token, timeout_s=60)
        store = dist.PrefixStore(GROUP, client)
        assert not store.check(["joined/1"])
        hub = json.loads(store.get(LIVENESS_KEY))
        # A stranger at the liveness socket: the old protocol's line, then it hangs up. Rank 0 carries on.
        host, port = hub["address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"1\n")
        client.close()

        rank1 = subprocess.Popen(rank_cmd, cwd=REPO, env=_env(token), stdout=subprocess.DEVNULL,
                                 stderr=open(tmp_path / "rank1.log", "wb"))
        got = grpc_metrics(f"127.0.0.1:{grpc_port}", token, model, streams)
        assert trainer.poll() is None and rank1.poll() is None
        assert "dropped a connection" in log.read_text()
    finally:
        for proc in (trainer, rank1):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert_like_one_rank(got, one)
