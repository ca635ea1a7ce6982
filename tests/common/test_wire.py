"""The wire contract: stubs are fresh, tensors round-trip, weight streams verify."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.tensors import from_proto, to_proto
from services.common.weights.stream import WeightStreamAssembler, WeightStreamError, iter_weight_chunks

@pytest.mark.parametrize("stem", ["lockstep", "rendezvous"])
def test_generated_stubs_are_fresh(tmp_path, repo_root, stem):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the stubs")
    (tmp_path / "proto").mkdir()
    shutil.copy(repo_root / "proto" / f"{stem}.proto", tmp_path / "proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.",
         f"proto/{stem}.proto"], cwd=tmp_path, check=True,
    )
    for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"):
        fresh = (tmp_path / "proto" / name).read_text()
        committed = (repo_root / "proto" / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `make proto` and commit"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
def test_tensor_round_trip_is_bitwise(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    back = from_proto(to_proto(t), field="x")
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8) if dtype.is_floating_point else back,
                       t.view(torch.uint8) if dtype.is_floating_point else t)


def test_tensor_decode_names_the_field():
    msg = to_proto(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"^rollout_logprobs: expected dtype int32"):
        from_proto(msg, field="rollout_logprobs", dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^x: expected 2-d"):
        from_proto(msg, field="x", ndim=2)
    bad = pb.Tensor(dtype="float32", shape=[5], data=msg.data)
    with pytest.raises(ValueError, match=r"^y: 16 bytes do not hold shape \[5\]"):
        from_proto(bad, field="y")
    with pytest.raises(ValueError, match=r"^z.dtype: unknown dtype 'complex7'"):
        from_proto(pb.Tensor(dtype="complex7"), field="z")
    with pytest.raises(ValueError, match=r"^w: missing tensor"):
        from_proto(pb.Tensor(), field="w")


def _weights():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(64, 33, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}


def test_weight_stream_round_trip_in_small_chunks():
    w = _weights()
    chunks = list(iter_weight_chunks(w.items(), run_id="r", policy_version=3, chunk_bytes=1000))
    assert len(chunks) > 3 and chunks[-1].last and chunks[-1].total_chunks == len(chunks)
    asm = WeightStreamAssembler()
    for c in chunks:
        asm.add(c)
    out = asm.finish()
    assert asm.policy_version == 3 and set(out) == set(w)
    for k in w:
        assert torch.equal(out[k], w[k])


@pytest.mark.parametrize("corrupt", ["chunk_bytes", "total", "missing_last", "reorder"])
def test_weight_stream_refuses_corruption(corrupt):
    chunks = list(iter_weight_chunks(_weights().items(), run_id="r", policy_version=1, chunk_bytes=1000))
    if corrupt == "chunk_bytes":
        chunks[1].data = bytes([chunks[1].data[0] ^ 1]) + chunks[1].data[1:]
    elif corrupt == "total":
        chunks[-1].total_sha256 = "0" * 64
    elif corrupt == "missing_last":
        chunks = chunks[:-1]
    elif corrupt == "reorder":
        chunks[0], chunks[1] = chunks[1], chunks[0]
    asm = WeightStreamAssembler()
    with pytest.raises(WeightStreamError):
        for c in chunks:
            asm.add(c)
        asm.finish()
