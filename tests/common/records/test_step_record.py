"""Step records: round trip of the exact TrainStep messages, and loud failures on damaged files."""
from __future__ import annotations

import pytest

from proto import lockstep_pb2 as pb
from services.common.records.step_record import StepRecordMeta, read_step_record, write_step_record
from services.common.tensors import ids_to_proto

META = StepRecordMeta(run_id="r1", step=3, policy_version=2, model_path="/m", seed=7, trainer_config_json='{"lr":1}')


def _chunks(n: int) -> list[pb.TrainStepChunk]:
    header = pb.TrainStepHeader(run_id="r1", step=3, policy_version=2, num_trajectories=n)
    trajs = [pb.Trajectory(run_id="r1", step=3, policy_version=2, group_id=f"g{i // 2}", sample_id=f"s{i}",
                           prompt_token_ids=ids_to_proto([1, 2, 3]), response_token_ids=ids_to_proto([4] * (i + 1)),
                           reward=float(i % 2), advantage=0.5 - i % 2) for i in range(n)]
    return [pb.TrainStepChunk(header=header), *(pb.TrainStepChunk(trajectory=t) for t in trajs)]


def test_round_trip_keeps_every_message_and_the_metadata(tmp_path):
    chunks = _chunks(5)
    path = write_step_record(tmp_path / "a" / "step_000003.pb", META, chunks)
    meta, back = read_step_record(path)
    assert meta == META
    assert [c.SerializeToString(deterministic=True) for c in back] == \
        [c.SerializeToString(deterministic=True) for c in chunks]
    assert not list(tmp_path.glob("a/*.tmp"))


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"NOT A RECORD\n" + b, "bad magic"),
    (lambda b: b[:-3], "truncated"),
    (lambda b: b.replace(b'"seed": 7', b'"seeed": 7'), "bad metadata line"),
])
def test_damaged_records_are_refused(tmp_path, damage, message):
    path = write_step_record(tmp_path / "r.pb", META, _chunks(2))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        read_step_record(path)


def test_missing_record_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="record: no such file"):
        read_step_record(tmp_path / "nope.pb")
