"""The IPC source's choice on a fleet it cannot reach whole, with real processes.

One replica runs in an IPC namespace of its own (unshare: a user namespace mapping this user to root in it,
and a new IPC namespace; the network is the host's), which is what a container without --ipc=host is: its
shared memory and CUDA IPC handles are not the trainer's. `auto` then syncs over its fallback and records why,
naming the replica; explicit `ipc` fails the run at its start naming the same reason, before any weights move.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from recipes.tiny_model import build_model_dir
from services.local_stack import LocalStack
from tests.conftest import require
from tests.support.weight_sync_runs import run_events, sync_spec

pytestmark = pytest.mark.slow

UNSHARE = ["unshare", "--user", "--map-root-user", "--ipc"]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0


def test_auto_falls_back_and_explicit_ipc_fails_when_a_replica_is_in_another_ipc_namespace(tmp_path):
    require(_unshare_works(), "unshare --user --ipc is unavailable (util-linux, unprivileged user namespaces)")
    model = build_model_dir(tmp_path / "model", seed=2)
    stack = LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[tmp_path])
    apart = stack.rollouts[1]
    apart.args = [*UNSHARE, *apart.args]
    address = f"127.0.0.1:{stack.rollout_ports[1]}"
    with stack:
        client = stack.client(timeout_s=60)
        run = client.submit({**sync_spec(model, "fallback", "auto"), "steps": 1})
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        chosen = run_events(client, run["id"], "weight_source_chosen")
        assert [(e["source"], e["configured"]) for e in chosen] == [("grpc", "auto")], chosen
        assert address in chosen[0]["reason"] and "IPC namespace" in chosen[0]["reason"]
        assert {e["source"] for e in run_events(client, run["id"], "weights_synced")} == {"grpc"}

        run = client.submit({**sync_spec(model, "refused", "ipc"), "steps": 1})
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "failed", done
        assert "rollout.weight_sync: 'ipc' cannot reach the fleet" in done["error"] and address in done["error"]
        assert not run_events(client, run["id"], "weights_synced")
