"""How long a run waits between attempts of a checkpoint refused for lack of disk space, and when it
stops retrying and pauses."""
from __future__ import annotations

from services.coordinator.run.trainer_session import SpaceRetry


def _waits(retry: SpaceRetry) -> list[float]:
    """The waits the run would take if every attempt were refused, each attempt taking no time."""
    waits, waited = [], 0.0
    while (wait := retry.next_wait(len(waits) + 1, waited)) is not None:
        waits.append(wait)
        waited += wait
    return waits


def test_waits_double_up_to_the_longest_and_stay_within_the_window():
    assert _waits(SpaceRetry(window_s=100.0, interval_s=5.0, interval_max_s=20.0)) == [5, 10, 20, 20, 20, 20]
    assert _waits(SpaceRetry(window_s=14.0, interval_s=1.0, interval_max_s=60.0)) == [1, 2, 4]


def test_a_window_of_zero_pauses_at_the_first_refusal():
    assert SpaceRetry(window_s=0.0, interval_s=0.1, interval_max_s=1.0).next_wait(1, 0.0) is None


def test_time_spent_in_the_attempts_counts_against_the_window():
    retry = SpaceRetry(window_s=10.0, interval_s=1.0, interval_max_s=60.0)
    assert retry.next_wait(1, 0.0) == 1.0
    assert retry.next_wait(1, 9.5) is None  # the attempt itself took 9.5 s: a 1 s wait would end past 10 s


def test_a_long_refusal_streak_neither_overflows_nor_passes_the_longest_wait():
    assert SpaceRetry(window_s=1e9, interval_s=5.0, interval_max_s=60.0).next_wait(5000, 0.0) == 60.0
