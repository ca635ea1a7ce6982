"""Which step the run loop runs next, given the trainer's version and the recorded cursor."""
from __future__ import annotations

import pytest

from services.coordinator.run.loop import RunFailed, next_step


@pytest.mark.parametrize("version, cursor, expected", [
    (0, 0, 1),   # fresh run
    (5, 5, 6),   # steady state
    (6, 5, 6),   # applied but not recorded (coordinator died): replay step 6
    (2, 5, 3),   # trainer came back from the step-2 checkpoint: recompute 3, 4, 5
    (0, 5, 1),   # came back with no checkpoint: recompute from the start
])
def test_next_step(version, cursor, expected):
    assert next_step(version, cursor) == expected


def test_trainer_more_than_one_step_ahead_of_the_record_fails_the_run():
    with pytest.raises(RunFailed, match="policy version 7, but only 5 steps are recorded"):
        next_step(7, 5)
