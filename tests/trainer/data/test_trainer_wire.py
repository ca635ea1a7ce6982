"""TrainStep stream decoding: every malformed input is refused with a message naming the field."""
from __future__ import annotations

import asyncio

import pytest

from proto import lockstep_pb2 as pb
from services.common.tensors import ids_to_proto, logprobs_to_proto
from services.trainer.data.wire import InvalidRequest, read_train_step


def header(n: int = 2, **kw) -> pb.TrainStepChunk:
    fields = dict(run_id="r", step=1, policy_version=0, num_trajectories=n) | kw
    return pb.TrainStepChunk(header=pb.TrainStepHeader(**fields))


def traj(i: int = 0, **kw) -> pb.TrainStepChunk:
    fields = dict(
        run_id="r", step=1, policy_version=0, group_id="g", sample_id=f"g/{i}",
        prompt_token_ids=ids_to_proto([1, 2]), response_token_ids=ids_to_proto([3, 4, 5]),
        rollout_logprobs=logprobs_to_proto([-0.5, -1.0, -2.0]), reward=1.0, advantage=0.5,
    ) | kw
    return pb.TrainStepChunk(trajectory=pb.Trajectory(**fields))


def read(chunks):
    async def stream():
        for c in chunks:
            yield c

    return asyncio.run(read_train_step(stream()))


def test_valid_stream_decodes():
    req = read([header(2), traj(0), traj(1)])
    assert (req.run_id, req.step, len(req.samples)) == ("r", 1, 2)
    s = req.samples[1]
    assert s.sample_id == "g/1" and s.prompt_ids.tolist() == [1, 2] and s.response_ids.tolist() == [3, 4, 5]
    assert s.rollout_logprobs.tolist() == [-0.5, -1.0, -2.0] and s.advantage == 0.5


def test_token_versions_outside_the_bound_are_a_failed_precondition_naming_the_step():
    from services.trainer.data.wire import FailedPrecondition

    ok = read([header(1, step=4, policy_version=2, max_staleness=1, streaming=True),
               traj(0, step=4, policy_version=2, token_policy_versions=[2, 3, 3])])
    assert ok.samples[0].response_ids.tolist() == [3, 4, 5]
    for h, t, message in (
        (header(1, step=4, policy_version=2, max_staleness=1, streaming=True),
         traj(0, step=4, policy_version=1, token_policy_versions=[1, 2, 2]), r"version 1 outside \[2, 3\]"),
        (header(1, step=4, policy_version=2, max_staleness=1),
         traj(0, step=4, policy_version=2, token_policy_versions=[2, 2, 3]), "fixed_lag trains step 4 on version 2"),
        (header(1), traj(0, policy_version=0, token_policy_versions=[0, 1, 1]), r"version 1 outside \[0, 0\]"),
    ):
        with pytest.raises(FailedPrecondition, match=f"^step {h.header.step}: .*{message}"):
            read([h, t])


def test_each_trajectory_carries_how_many_versions_its_tokens_lag_the_trainer():
    # The trainer of step 4 is at version 3; the sums feed lr_schedule.staleness_factor.
    streaming = read([header(2, step=4, policy_version=1, max_staleness=2, streaming=True),
                      traj(0, step=4, policy_version=1, token_policy_versions=[1, 2, 3]),
                      traj(1, step=4, policy_version=3, token_policy_versions=[3, 3, 3])])
    assert [s.staleness_sum for s in streaming.samples] == [2 + 1 + 0, 0]
    fixed_lag = read([header(1, step=4, policy_version=1, max_staleness=2), traj(0, step=4, policy_version=1)])
    assert fixed_lag.samples[0].staleness_sum == 3 * 2  # no versions sent: every token at the trajectory's
    assert read([header(1), traj(0)]).samples[0].staleness_sum == 0  # synchronous


def test_replay_header_without_trajectories_is_well_formed():
    assert read([header(0)]).samples == []


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([traj(0)], r"message\[0\]: header missing"),
        ([], "header missing: empty TrainStep stream"),
        ([header(1), header(1)], r"message\[1\]: second header"),
        ([header(2), traj(0), traj(1, run_id="other")], r"trajectory\[1\]\.run_id: 'other' but the header says 'r'"),
        ([header(1), traj(0, step=2)], r"trajectory\[0\]\.step: 2"),
        ([header(1, step=0)], "header.step: must be >= 1"),
        ([header(1, policy_version=1)], "header.policy_version: 1 cannot have generated step 1"),
        ([header(2), traj(0), traj(1, rollout_logprobs=logprobs_to_proto([-1.0] * 5),
                                    response_token_ids=ids_to_proto([3] * 6))],
         r"trajectory\[1\]\.rollout_logprobs: 5 values for 6 response tokens"),
        ([header(1), traj(0, rollout_logprobs=logprobs_to_proto([-1.0, float("nan"), -1.0]))],
         r"trajectory\[0\]\.rollout_logprobs\[1\]: not finite \(nan\)"),
        ([header(1), traj(0, rollout_logprobs=logprobs_to_proto([-1.0, -1.0, float("-inf")]))],
         r"trajectory\[0\]\.rollout_logprobs\[2\]: not finite \(-inf\)"),
        ([header(1), traj(0, rollout_logprobs=logprobs_to_proto([0.5, -1.0, -1.0]))],
         r"rollout_logprobs\[0\]: 0.5 > 0 is not a log-prob"),
        ([header(1), traj(0, prompt_token_ids=ids_to_proto([]))], r"trajectory\[0\]\.prompt_token_ids: empty prompt"),
        ([header(1), traj(0, response_token_ids=ids_to_proto([]), rollout_logprobs=logprobs_to_proto([]))],
         "response_token_ids: empty response"),
        ([header(1), traj(0, prompt_token_ids=ids_to_proto([1, -4]))], "prompt_token_ids: negative token id -4"),
        ([header(1), traj(0, prompt_token_ids=pb.Tensor())], r"trajectory\[0\]\.prompt_token_ids: missing tensor"),
        ([header(1), traj(0, rollout_logprobs=pb.Tensor(dtype="float32", shape=[3], data=b"\0" * 8))],
         "rollout_logprobs: 8 bytes do not hold shape"),
        ([header(1), traj(0, response_token_ids=logprobs_to_proto([1.0, 2.0, 3.0]))],
         "response_token_ids: expected dtype int32, got float32"),
        ([header(1), traj(0, advantage=float("inf"))], r"trajectory\[0\]\.advantage: not finite"),
        ([header(2), traj(0), traj(0)], r"trajectory\[1\]\.sample_id: duplicate 'g/0'"),
        ([header(1), traj(0), traj(1)], r"trajectory\[1\]: more trajectories than header.num_trajectories=1"),
        ([header(3), traj(0), traj(1)], "header.num_trajectories: 3 announced, 2 received"),
        ([header(1), traj(0, sample_id="")], r"trajectory\[0\]\.sample_id: empty"),
        ([header(1), traj(0, token_policy_versions=[0, 0])],
         r"trajectory\[0\]\.token_policy_versions: 2 versions for 3 model tokens"),
        ([header(1, step=4, policy_version=2, max_staleness=1, streaming=True),
          traj(0, step=4, policy_version=3, token_policy_versions=[3, 2, 3])],
         r"trajectory\[0\]\.token_policy_versions\[1\]: 2 after 3: versions decrease"),
        ([header(1, step=4, policy_version=2)], r"header.policy_version: 2, but step 4 with max_staleness 0 trains on versions from 3"),
    ],
)
def test_malformed_streams_name_the_field(chunks, message):
    with pytest.raises(InvalidRequest, match=message):
        read(chunks)
