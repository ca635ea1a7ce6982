"""The scoring bookkeeping alone (the stack tests in tests/integration/rewards/ check it with real scorers): the
cache key covers every input and never joins two splits of the same text, the cache forgets the least recently
used, and a step's reward counts add up."""
from __future__ import annotations

from services.coordinator.rewards.scorers import ScoreInput
from services.coordinator.rewards.scoring import SampleReward, ScoreCache, reward_counts

IDENTITY = {"source": "judge", "weights_sha256": "w" * 64, "template_sha256": "t" * 64}


def test_the_cache_key_changes_with_every_input_and_not_with_the_item_id():
    item = ScoreInput("s1-g0/0", "1+1=", "2", "2")
    key = ScoreCache.key(IDENTITY, item)
    assert key == ScoreCache.key(IDENTITY, ScoreInput("s9-g3/1", "1+1=", "2", "2"))  # a replayed sample hits
    for other in (ScoreInput("x", "1+1=", "3", "2"), ScoreInput("x", "1+2=", "2", "2"),
                  ScoreInput("x", "1+1=", "2", "3"), ScoreInput("x", "1+1=2", "", "2")):  # a split moved
        assert ScoreCache.key(IDENTITY, other) != key
    for field in IDENTITY:
        assert ScoreCache.key({**IDENTITY, field: "other"}, item) != key


def test_the_cache_keeps_the_most_recently_used_entries():
    cache = ScoreCache(2)
    cache.put("a", {"score": 1.0})
    cache.put("b", {"score": 2.0})
    assert cache.get("a") == {"score": 1.0}  # a is now the most recent
    cache.put("c", {"score": 3.0})
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    off = ScoreCache(0)
    off.put("a", {"score": 1.0})
    assert off.get("a") is None


def test_reward_counts_add_drops_by_reason_failed_attempts_and_cache_hits():
    samples = [
        SampleReward("a", 1.0, None, {"reward_model": {"score": 1.0, "attempts": 1, "cached": False}}),
        SampleReward("b", 0.5, None, {"reward_model": {"score": 0.5, "attempts": 3, "cached": False}}),
        SampleReward("c", None, "timeout", {"reward_model": {"dropped": "timeout", "attempts": 3}}),
        SampleReward("d", 2.0, None, {"reward_model": {"score": 2.0, "attempts": 2, "cached": True}}),
        SampleReward("e", None, "scorer_unavailable", {"reward_model": {"dropped": "scorer_unavailable",
                                                                         "attempts": 0}}),
    ]
    assert reward_counts(samples) == {"reward_dropped": 2, "reward_dropped_timeout": 1,
                                      "reward_dropped_scorer_unavailable": 1, "reward_cache_hits": 1,
                                      "reward_failed_attempts": 2 + 3}
