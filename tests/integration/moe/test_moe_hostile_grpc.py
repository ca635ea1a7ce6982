"""Hostile expert ids over gRPC against a real trainer process holding a tiny Qwen3-MoE run with routing replay:
an id out of range, the wrong number of experts per token or of layers, a read position without ids and the
never-read last position carrying one are each INVALID_ARGUMENT naming the trajectory, the trainer's policy
version and weights stay, and the honest step trains after them."""
from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from proto import lockstep_pb2 as pb
from recipes.tiny_moe import TinyMoeConfig, build_moe_model_dir
from services.common.tensors import ids_to_proto, logprobs_to_proto
from tests.integration.test_hostile_grpc import INVALID, Served, _train_step, _trainer_version, _unary, code_of

LAYERS, TOP_K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_moe_model_dir(tmp_path_factory.mktemp("moe") / "m", TinyMoeConfig(), seed=1)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    s = Served("trainer", tmp_path_factory.mktemp("trainer"), tmp_path_factory.getbasetemp()).start()
    yield s
    s.stop()


def _routed(rows: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype="uint8", shape=list(rows.shape), data=rows.astype(np.uint8).tobytes())


def _honest(tokens: int) -> np.ndarray:
    rows = np.stack([np.stack([(np.arange(TOP_K) + t + layer) % EXPERTS for layer in range(LAYERS)])
                     for t in range(tokens)])
    rows[-1] = 255
    return rows


def _weights(trainer, run_id: str) -> bytes:
    chunks = trainer.channel.unary_stream(trainer.method("GetWeights"),
                                          request_serializer=pb.GetWeightsRequest.SerializeToString,
                                          response_deserializer=pb.WeightChunk.FromString)(
        pb.GetWeightsRequest(run_id=run_id), timeout=120)
    return b"".join(c.SerializeToString() for c in chunks)


def test_impossible_expert_ids_are_refused_naming_the_trajectory_and_nothing_trains(trainer, moe_dir):
    run_id = f"moe-{uuid.uuid4().hex}"
    config = {"moe": {"routing_replay": True},
              "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9}}
    _unary(trainer, "ConfigureRun", pb.ConfigureRunRequest(run_id=run_id, model_path=str(moe_dir), seed=0,
                                                           trainer_config_json=json.dumps(config)),
           pb.ConfigureRunResponse)
    before = _weights(trainer, run_id)

    def traj(i: int, routed: np.ndarray | None) -> pb.Trajectory:
        t = pb.Trajectory(run_id=run_id, step=1, policy_version=0, group_id="g", sample_id=f"g/{i}",
                          prompt_token_ids=ids_to_proto([1, 2]), response_token_ids=ids_to_proto([3, 4, 5]),
                          rollout_logprobs=logprobs_to_proto([-1.0, -1.5, -2.0]), reward=1.0, advantage=1.0 - 2 * i)
        if routed is not None:
            t.routed_experts.CopyFrom(_routed(routed))
        return t

    header = pb.TrainStepHeader(run_id=run_id, step=1, policy_version=0, num_trajectories=2)
    honest = _honest(5)
    out_of_range, last_carries, hole = honest.copy(), honest.copy(), honest.copy()
    out_of_range[2, 1, 0] = EXPERTS
    last_carries[-1] = 0  # expert 0 is a valid id: the padded position must not carry it
    hole[1, 0] = 255
    cases = [(out_of_range, "out of range"), (honest[:, :, :1], "experts per token"),
             (honest[:, :1], "experts per token"), (last_carries, "padding but carries an expert id"),
             (hole, "position 1 was read by the model but has no expert id"), (honest[:4], "4 rows for 5"),
             (None, "absent, but trainer.moe.routing_replay")]
    for routed, fragment in cases:
        got, details = code_of(lambda: _train_step(trainer, header, [traj(0, honest), traj(1, routed)]))
        assert got == INVALID and "trajectory[1]" in details and fragment in details, (got, details)
        assert _trainer_version(trainer) == 0
    assert _weights(trainer, run_id) == before
    metrics = _train_step(trainer, header, [traj(0, honest), traj(1, honest)])
    assert metrics.step == 1 and _trainer_version(trainer) == 1
    assert set(metrics.metrics) >= {"moe_routing_agreement_layer_0", "moe_routing_agreement_layer_1"}
    assert _weights(trainer, run_id) != before
