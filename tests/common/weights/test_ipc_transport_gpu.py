"""The IPC handover's CUDA transport (HIP on ROCm) between two processes on one GPU (gpu marker).

The trainer's handover host (this process) packs bf16 and fp32 tensors into device buckets and hands one
share's handles out; a second process checks them, maps them on its own index of the device the trainer
named by UUID, hashes them through the pinned ring, copies them into tensors of its own and drops the
mapping. The digest equals the gRPC stream's over the same tensors, the weights are equal bit for bit,
handles for a device the process does not see are refused, and once the share is released the trainer's
buckets are freed.

Run on a GPU machine: `python -m pytest -q -m gpu tests/common/weights/test_ipc_transport_gpu.py`.
"""
from __future__ import annotations

import io
import logging
import multiprocessing

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.weights import ipc_transport as ipc
from services.common.weights.digest import tensors_digest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


class _Trainer:
    def __init__(self, named) -> None:
        self.named = named

    def weight_tensors(self, run_id: str, *, cast: bool = True):  # the tensors as given, whatever `cast` says
        from services.trainer.run_state import WeightSnapshot
        return WeightSnapshot(None, 0, 5, list(self.named))

    def check_weights_unchanged(self, snapshot) -> None:
        pass


def _map_on_gpu(raw: bytes, node: str, out) -> None:
    from services.common.weights.bucket_digest import BucketHasher
    handles = pb.WeightHandles.FromString(raw)
    try:
        layouts = ipc.check_handles(handles, run_id="r", policy_version=5, handover_id=handles.handover_id,
                                    current_version=4, node=node)
        index = ipc.local_index(handles.device_uuid)
        mapped = [ipc.open_bucket("cuda", b, index) for b in handles.buckets]
        hasher = BucketHasher(4)
        digest = hasher.digest(mapped, layouts)
        copies = {name: t.clone() for m, lay in zip(mapped, layouts) for name, t in ipc.bucket_views(m, lay)}
        torch.cuda.synchronize()
        mapped.clear()  # unmapped: torch releases the share's counter
        hasher.close()
        # Plain bytes through the queue: a tensor would be shared by file descriptor, which the parent
        # can only fetch while this process lives.
        buffer = io.BytesIO()
        torch.save({name: t.cpu() for name, t in copies.items()}, buffer)
        out.put((digest, buffer.getvalue()))
    except Exception as exc:
        out.put(("error", repr(exc)))


def test_two_processes_on_one_gpu_hand_weights_over_in_place():
    g = torch.Generator().manual_seed(0)
    cpu = [("model.embed_tokens.weight", torch.randn(4096, 1100, generator=g).to(torch.bfloat16)),  # > 4 MiB
           ("model.norm.weight", torch.randn(1100, generator=g)),
           *[(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(700, 300, generator=g).to(torch.bfloat16))
             for i in range(5)]]
    from services.trainer.weights.ipc_sender import HandoverRefused, WeightHandoverHost
    host = WeightHandoverHost(_Trainer([(n, t.cuda()) for n, t in cpu]), bucket_bytes=2 << 20,
                              logger=logging.getLogger("test"))
    try:
        opened = host.open(pb.OpenWeightHandoverRequest(run_id="r", replicas=1))
        assert opened.backend == "cuda" and opened.device_uuid == ipc.device_uuid(torch.cuda.current_device())
        assert opened.buckets == 3
        ask = dict(run_id="r", policy_version=5, handover_id=opened.handover_id, node_id=ipc.node_id())
        with pytest.raises(HandoverRefused, match="device_uuids"):
            host.handles(pb.GetWeightHandlesRequest(**ask, device_uuids=["GPU-not-this-one"]))
        handles = host.handles(pb.GetWeightHandlesRequest(**ask, device_uuids=ipc.visible_device_uuids()))
        elsewhere = pb.WeightHandles()
        elsewhere.CopyFrom(handles)
        elsewhere.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
        with pytest.raises(ipc.HandleRefused, match="does not see"):
            ipc.local_index(elsewhere.device_uuid)

        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        child = context.Process(target=_map_on_gpu, args=(handles.SerializeToString(), ipc.node_id(), out))
        child.start()
        digest, got = out.get(timeout=300)
        child.join(timeout=120)
        assert digest != "error", got
        got = torch.load(io.BytesIO(got))
        assert digest == tensors_digest(cpu)[0]
        assert set(got) == {n for n, _ in cpu}
        assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in cpu)
        assert host.verify(pb.VerifyWeightHandoverRequest(run_id="r", handover_id=opened.handover_id,
                                                          share_id=handles.share_id,
                                                          total_sha256=digest)).total_sha256 == digest
        before = torch.cuda.memory_allocated()
        released = host.release(pb.ReleaseWeightHandlesRequest(
            run_id="r", handover_id=opened.handover_id, share_id=handles.share_id,
            mapped_buckets=len(handles.buckets)))
        assert released.outstanding == 0
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= before - 3 * (2 << 20) // 2  # the buckets went back
    finally:
        host.close()
