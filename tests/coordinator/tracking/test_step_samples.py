"""Kept samples: written whole, bounded to the last keep_steps steps, paged and ordered as documented."""
from __future__ import annotations

import numpy as np

from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.coordinator.tracking.step_samples import StepSamples, page, path_steps, read_samples


def trajectory(group: int, index: int, reward: float, response: list[int], versions=()) -> pb.Trajectory:
    return pb.Trajectory(group_id=f"g{group}", sample_id=f"g{group}/{index}", policy_version=3,
                         token_policy_versions=list(versions), prompt_token_ids=ids_to_proto([1, 2]),
                         response_token_ids=ids_to_proto(response), reward=reward, advantage=reward - 0.5,
                         finish_reason="stop")


def decode(ids) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_samples_are_the_trajectories_with_text_and_exact_floats(tmp_path):
    store = StepSamples(tmp_path, keep_steps=3, decode=decode)
    third = float(np.float32(1 / 3))
    store.put(1, [trajectory(0, 0, third, [3, 4]), trajectory(0, 1, 1.0, [5], versions=[3, 4])],
              {"g0/1": (0.5, 2.0)})
    a, b = read_samples(tmp_path, 1)
    assert (a["iw_min"], a["iw_max"], b["iw_min"], b["iw_max"]) == (None, None, 0.5, 2.0)
    assert a["reward"] == third and a["advantage"] == float(np.float32(third - 0.5))
    assert (a["prompt"], a["response"], a["response_token_ids"], a["length"]) == ("bc", "de", [3, 4], 2)
    assert (a["policy_version"], a["policy_version_last"]) == (3, 3)
    assert (b["policy_version"], b["policy_version_last"], b["index"]) == (3, 4, 1)


def test_only_the_last_keep_steps_steps_are_kept(tmp_path):
    store = StepSamples(tmp_path, keep_steps=2, decode=decode)
    for step in range(1, 6):
        store.put(step, [trajectory(0, 0, 0.0, [1])])
    assert path_steps(tmp_path) == [4, 5]
    assert read_samples(tmp_path, 3) is None and read_samples(tmp_path, 5) is not None
    assert StepSamples(tmp_path / "none", keep_steps=0, decode=decode).put(1, []) is None
    assert path_steps(tmp_path / "none") == []


def test_the_oldest_steps_go_first_past_keep_bytes_but_never_the_newest(tmp_path):
    one = StepSamples(tmp_path / "probe", keep_steps=1, decode=decode)
    size = one.put(1, [trajectory(0, 0, 0.0, [1, 2, 3])]).stat().st_size
    store = StepSamples(tmp_path, keep_steps=100, decode=decode, keep_bytes=3 * size)
    for step in range(1, 6):
        store.put(step, [trajectory(0, 0, 0.0, [1, 2, 3])])
    assert path_steps(tmp_path) == [3, 4, 5]
    tiny = StepSamples(tmp_path / "tiny", keep_steps=100, decode=decode, keep_bytes=1)
    for step in (1, 2):
        tiny.put(step, [trajectory(0, 0, 0.0, [1, 2, 3])])
    assert path_steps(tmp_path / "tiny") == [2]


def test_pages_order_by_reward_with_ties_in_record_order_and_filter_groups(tmp_path):
    rewards = [0.5, 0.0, 1.0, 0.0, 0.5, 1.0]
    StepSamples(tmp_path, 1, decode).put(1, [trajectory(i // 3, i % 3, r, [1]) for i, r in enumerate(rewards)])
    samples = read_samples(tmp_path, 1)
    assert [s["index"] for s in page(samples, order="worst")[1]] == [1, 3, 0, 4, 2, 5]
    assert [s["index"] for s in page(samples, order="best")[1]] == [2, 5, 0, 4, 1, 3]
    assert page(samples, order="best", offset=1, limit=2) == (6, page(samples, order="best")[1][1:3])
    total, mine = page(samples, group="g1")
    assert total == 3 and [s["sample_id"] for s in mine] == ["g1/0", "g1/1", "g1/2"]


def test_a_refused_write_leaves_no_half_written_file(tmp_path, monkeypatch):
    """A full disk refuses the write midway: the error reaches the caller (who logs it) and the partial
    temp file is gone, so nothing under the run directory could pass for kept samples."""
    import errno
    from pathlib import Path

    store = StepSamples(tmp_path, keep_steps=3, decode=decode)
    real_write = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", half_then_full)
    try:
        store.put(1, [trajectory(0, 0, 1.0, [3])])
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    else:
        raise AssertionError("the refused write did not raise")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
    assert read_samples(tmp_path, 1) is None
