"""The IPC weight source through the real stack on one GPU (gpu marker): trainer and replica are two processes
on the same device, each version goes over CUDA IPC (HIP on ROCm), and a run's metrics and every version's
digest are bitwise those of the gRPC source, with the choice recorded as ipc on that GPU, whether both services
hash the buckets on the host or on the device (weight_ipc_digest).

Run on a GPU machine: `python -m pytest -q -m gpu tests/integration/weights/test_ipc_weights_gpu.py`.
"""
from __future__ import annotations

import pytest
import torch

from recipes.tiny_model import build_model_dir
from services.common.weights.ipc_transport import device_uuid
from services.local_stack import LocalStack
from tests.support.stack_logs import text_after
from tests.support.weight_sync_runs import run_events, sync_spec, synced

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


@pytest.mark.parametrize("digest_on", ["host", "device"])
def test_ipc_over_cuda_matches_the_grpc_source_bitwise(tmp_path, digest_on):
    model = build_model_dir(tmp_path / "model", seed=2)
    env = {"LOCKSTEP_TRAINER_DEVICE": "cuda", "LOCKSTEP_TRAINER_WEIGHT_IPC_DIGEST": digest_on,
           "LOCKSTEP_ROLLOUT_WEIGHT_IPC_DIGEST": digest_on}
    with LocalStack(tmp_path / "stack", path_roots=[tmp_path], extra_env=env) as stack:
        client = stack.client(timeout_s=60)
        outcomes = {}
        for source in ("grpc", "ipc"):
            spec = sync_spec(model, f"gpu-{source}", source)
            spec["rollout"]["engine_options"] = {"device": "cuda", "dtype": "bfloat16"}
            spec["trainer"] = {"dtype": "bfloat16"}
            run = client.submit(spec)
            done = client.wait(run["id"], timeout_s=600)
            assert done["status"] == "completed", done
            outcomes[source] = (run["id"], [s["metrics"] for s in client.metrics(run["id"])["steps"]],
                                synced(client, run["id"]))
        (_, grpc_metrics, grpc_synced), (ipc_id, ipc_metrics, ipc_synced) = outcomes.values()
        assert len(ipc_metrics) == 3 and ipc_metrics == grpc_metrics
        assert [s[0] for s in ipc_synced] == [1, 2, 3] and ipc_synced == grpc_synced
        chosen = run_events(client, ipc_id, "weight_source_chosen")
        assert [e["source"] for e in chosen] == ["ipc"] and device_uuid(0) in chosen[0]["reason"], chosen
        trainer_log = text_after(stack.run_dir / "logs" / "trainer.log", 0)
        assert '"backend": "cuda"' in trainer_log and trainer_log.count('"weight handover closed"') == 3
