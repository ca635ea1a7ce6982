"""The per-token staleness bound the trainer enforces (services/trainer/data/token_versions.py), as pure logic."""
from __future__ import annotations

import pytest

from services.trainer.data.token_versions import check_header_bound, check_token_versions, lowest_version
from services.trainer.data.wire_errors import FailedPrecondition, InvalidRequest


def check(versions, *, step=5, trajectory_version=None, num_tokens=None, header_version=None, k=2, streaming=True):
    lowest = lowest_version(step, k)
    return check_token_versions(versions, where="trajectory[0]", step=step,
                                trajectory_version=versions[0] if trajectory_version is None else trajectory_version,
                                num_tokens=len(versions) if num_tokens is None else num_tokens,
                                header_version=lowest if header_version is None else header_version,
                                max_staleness=k, streaming=streaming)


def test_lowest_version_is_the_fixed_lag_arithmetic():
    assert [lowest_version(s, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert [lowest_version(s, 0) for s in (1, 2, 3)] == [0, 1, 2]


@pytest.mark.parametrize("versions", [[2, 2, 2], [2, 3, 4], [4, 4], [3, 4, 4]])
def test_streaming_admits_rising_versions_inside_the_bound(versions):
    assert check(versions) == versions  # step 5, K 2: [2, 4]


@pytest.mark.parametrize("versions, error, message", [
    ([1, 2, 2], FailedPrecondition, r"step 5: trajectory\[0\]\.token_policy_versions\[0\]: version 1 outside \[2, 4\]"),
    ([2, 3, 5], FailedPrecondition, r"step 5: .*token_policy_versions\[2\]: version 5 outside \[2, 4\]"),
    ([3, 2, 4], InvalidRequest, r"token_policy_versions\[1\]: 2 after 3: versions decrease .*\(step 5\)"),
    ([4, 4, 3], InvalidRequest, r"token_policy_versions\[2\]: 3 after 4"),
])
def test_streaming_refuses_stale_future_and_falling_versions(versions, error, message):
    with pytest.raises(error, match=message):
        check(versions)


def test_fixed_lag_admits_only_the_steps_version():
    check([2, 2, 2], streaming=False)
    with pytest.raises(FailedPrecondition, match=r"step 5: .*\[1\]: version 3, but fixed_lag trains step 5 on version 2"):
        check([2, 3, 3], streaming=False)


def test_synchronous_step_admits_only_the_previous_version():
    check([4, 4], k=0, streaming=False)
    with pytest.raises(FailedPrecondition, match=r"version 3 outside \[4, 4\]"):
        check([3, 3], k=0, header_version=4, streaming=False)


def test_count_and_first_token_must_match_the_trajectory():
    with pytest.raises(InvalidRequest, match=r"token_policy_versions: 2 versions for 3 model tokens \(step 5\)"):
        check([3, 3], num_tokens=3)
    with pytest.raises(InvalidRequest, match=r"trajectory\[0\]\.policy_version: 4, but its first token's version is 3"):
        check([3, 4], trajectory_version=4)


def test_no_versions_means_every_token_at_the_trajectory_version():
    assert check([], trajectory_version=3, num_tokens=4) == [3, 3, 3, 3]
    with pytest.raises(FailedPrecondition, match=r"\[0\]: version 1 outside \[2, 4\]"):
        check([], trajectory_version=1, num_tokens=4)


def test_header_must_state_the_lowest_version_of_its_bound():
    check_header_bound(5, 2, 2)
    check_header_bound(1, 0, 3)
    with pytest.raises(InvalidRequest, match=r"header.policy_version: 3, but step 5 with max_staleness 2 trains on "
                                             r"versions from 2"):
        check_header_bound(5, 3, 2)
    with pytest.raises(InvalidRequest, match=r"header.max_staleness: 65 outside \[0, 64\] \(step 5\)"):
        check_header_bound(5, 0, 65)
    with pytest.raises(InvalidRequest, match="header.max_staleness: -1"):
        check_header_bound(5, 0, -1)
