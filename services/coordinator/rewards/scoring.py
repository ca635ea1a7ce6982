"""A step's rewards from scorer models: batched Score calls, bounded retries, the cache, the counts, and the
ledger that traces every reward to the call that produced it.

For each model source (reward_model, judge) the samples not in the cache are sent in batches of
reward.batch_size, spread over the source's live replicas. An item whose attempt gave no score
(verdicts.FAILURE_REASONS) is counted (lockstep_reward_failures_total{source, reason}) and sent again, to the
next replica in turn, until reward.max_attempts; past that it is dropped from the step, counted by its last
reason, and never trained on. A step whose dropped fraction exceeds reward.max_failed_fraction fails the run,
naming the reasons. A sample's reward is the weighted sum over the spec's sources; a sample dropped by any
source is dropped.

Scores are cached by (scorer weights digest, template hash, prompt, response, reference), so a retried or
recomputed step asks no scorer twice for the same thing.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.coordinator.clients import RolloutClient
from services.coordinator.rewards.scorers import ScoreInput, ScorerGroup
from services.coordinator.rewards.spec import RewardSpec
from services.coordinator.rewards.verdicts import ScoreRefused
from services.coordinator.run.errors import RunFailed


@dataclass
class SampleReward:
    """One sample's reward, or why it has none, and where each part came from."""

    item_id: str
    reward: float | None = None
    dropped: str | None = None  # the reason it got no reward (then `reward` is None)
    parts: dict[str, dict] = field(default_factory=dict)  # source -> score, call_id, replica, attempts, cached, ...


class ScoreCache:
    """Least-recently-used scores by content key, at most `entries` of them."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._scores: OrderedDict[str, dict] = OrderedDict()

    @staticmethod
    def key(identity: Mapping[str, str], item: ScoreInput) -> str:
        h = hashlib.sha256()
        for part in (identity.get("source", ""), identity.get("weights_sha256", ""),
                     identity.get("template_sha256", ""), item.prompt, item.response, item.reference):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no two splits hash alike
        return h.hexdigest()

    def get(self, key: str) -> dict | None:
        hit = self._scores.get(key)
        if hit is not None:
            self._scores.move_to_end(key)
        return hit

    def put(self, key: str, part: dict) -> None:
        if self.entries <= 0:
            return
        self._scores[key] = part
        self._scores.move_to_end(key)
        while len(self._scores) > self.entries:
            self._scores.popitem(last=False)


class RewardScoring:
    """The run's model rewards. `scorers`: the coordinator's scorer replicas (its scorer_addresses)."""

    def __init__(self, run_id: str, spec: RewardSpec, scorers: Sequence[RolloutClient], exporter) -> None:
        self.run_id, self.spec, self.exporter = run_id, spec, exporter
        by_address = {c.address: c for c in scorers}
        self.groups: dict[str, ScorerGroup] = {}
        for source in spec.model_sources():
            section = getattr(spec, source)
            missing = [a for a in section.replicas if a not in by_address]
            if missing:  # the REST edge refuses these; a stored spec meeting another coordinator may not
                raise RunFailed(f"reward.{source}.replicas: {missing} are not this coordinator's scorer replicas")
            clients = [by_address[a] for a in section.replicas] if section.replicas else list(scorers)
            self.groups[source] = ScorerGroup(run_id, source, section, clients, spec.timeout_s)
        self.cache = ScoreCache(spec.cache_entries)
        self._soon: dict[tuple[int, str], asyncio.Task] = {}  # (step, item id) -> its sources' parts, in flight

    async def start(self) -> list[dict[str, str]]:
        """Load every source's model on its replicas; their identities (for the fingerprint and records)."""
        return [await group.start() for group in self.groups.values()]

    def identity(self) -> list[dict[str, str]]:
        return [group.identity for group in self.groups.values()]

    def score_soon(self, step: int, items: Sequence[ScoreInput]) -> None:
        """Start scoring `items` now (a replica's samples arrived while others still generate); score() of the
        same step then awaits these calls instead of making its own."""
        if items:
            task = asyncio.ensure_future(self._score_items(step, items))
            for item in items:
                self._soon[(step, item.item_id)] = task

    async def _score_items(self, step: int, items: Sequence[ScoreInput]) -> dict[str, dict[str, dict]]:
        """{item id: {source: part}} over every model source."""
        per_source = await asyncio.gather(*(self._score_source(g, items, step) for g in self.groups.values()))
        return {item.item_id: {source: parts[item.item_id] for source, parts in zip(self.groups, per_source)}
                for item in items}

    async def score(self, step: int, items: Sequence[ScoreInput],
                    rule_rewards: Sequence[float] | None) -> list[SampleReward]:
        """Every item's reward (or its drop), in order. RunFailed if the dropped fraction passes the bound."""
        for group in self.groups.values():
            await group.readmit()
        started = {self._soon.pop((step, item.item_id)) for item in items if (step, item.item_id) in self._soon}
        done: dict[str, dict[str, dict]] = {}
        for task in started:
            done.update(await task)  # a failure of one (RunFailed) is raised here, as score()'s own would be
        rest = [item for item in items if item.item_id not in done]
        if rest:
            done.update(await self._score_items(step, rest))
        weights = self.spec.sources()
        out = []
        for k, item in enumerate(items):
            sample = SampleReward(item.item_id)
            total = 0.0
            if "rule" in weights:
                sample.parts["rule"] = {"score": float(rule_rewards[k])}
                total += weights["rule"] * float(rule_rewards[k])
            for source, part in done[item.item_id].items():
                sample.parts[source] = part
                if "dropped" in part:
                    sample.dropped = sample.dropped or part["dropped"]
                else:
                    total += weights[source] * part["score"]
            if sample.dropped is None:
                sample.reward = total
            else:
                self.exporter.reward_dropped(self.run_id, sample.dropped)
            out.append(sample)
        self._check_bound(step, out)
        return out

    def _check_bound(self, step: int, samples: Sequence[SampleReward]) -> None:
        reasons = Counter(s.dropped for s in samples if s.dropped is not None)
        dropped = sum(reasons.values())
        if samples and dropped / len(samples) > self.spec.max_failed_fraction:
            raise RunFailed(f"step {step}: {dropped} of {len(samples)} samples got no reward after "
                            f"{self.spec.max_attempts} attempts ({', '.join(f'{r}: {n}' for r, n in sorted(reasons.items()))}"
                            f"), above reward.max_failed_fraction {self.spec.max_failed_fraction}")

    async def _score_source(self, group: ScorerGroup, items: Sequence[ScoreInput], step: int) -> dict[str, dict]:
        parts: dict[str, dict] = {}
        keys = {item.item_id: self.cache.key(group.identity, item) for item in items}
        pending = []
        for item in items:
            hit = self.cache.get(keys[item.item_id])
            if hit is not None:
                parts[item.item_id] = {**hit, "cached": True}
                self.exporter.reward_scored(self.run_id, group.source, hit["score"], cached=True)
            else:
                pending.append(item)
        attempts: Counter[str] = Counter()
        turn = 0
        while pending:
            live = group.live()
            if not live:  # every replica of the source is gone: what is left cannot be scored this step
                for item in pending:
                    parts[item.item_id] = {"dropped": "scorer_unavailable", "attempts": attempts[item.item_id]}
                break
            self.exporter.reward_queue_depth(self.run_id, len(pending))
            size = self.spec.batch_size
            batches = [pending[i:i + size] for i in range(0, len(pending), size)]
            calls = await asyncio.gather(*(group.call(live[(k + turn) % len(live)], batch, step)
                                           for k, batch in enumerate(batches)))
            pending = []
            for batch, call in zip(batches, calls):
                self.exporter.reward_call(self.run_id, group.source, call.seconds, len(batch))
                for item in batch:
                    attempts[item.item_id] += 1
                    outcome = call.outcomes[item.item_id]
                    trace = {"call_id": call.call_id, "replica": call.replica, "attempts": attempts[item.item_id]}
                    if item.item_id in call.verdicts:
                        trace["verdict"] = call.verdicts[item.item_id]
                    if isinstance(outcome, ScoreRefused):
                        self.exporter.reward_failure(self.run_id, group.source, outcome.reason)
                        if attempts[item.item_id] < self.spec.max_attempts:
                            pending.append(item)
                        else:
                            parts[item.item_id] = {**trace, "dropped": outcome.reason, "detail": outcome.detail}
                        continue
                    part = {**trace, "score": float(outcome), "cached": False}
                    parts[item.item_id] = part
                    self.cache.put(keys[item.item_id], {k: v for k, v in part.items() if k != "cached"})
                    self.exporter.reward_scored(self.run_id, group.source, float(outcome), cached=False)
            turn += 1
        self.exporter.reward_queue_depth(self.run_id, 0)
        return parts


def reward_counts(samples: Sequence[SampleReward]) -> dict[str, float]:
    """A scoring call's numbers for the step's metrics (summed over dynamic sampling's rounds)."""
    counts: dict[str, float] = {"reward_dropped": 0.0, "reward_cache_hits": 0.0, "reward_failed_attempts": 0.0}
    for s in samples:
        if s.dropped is not None:
            counts["reward_dropped"] += 1
            counts[f"reward_dropped_{s.dropped}"] = counts.get(f"reward_dropped_{s.dropped}", 0.0) + 1
        for part in s.parts.values():
            if part.get("cached"):  # its attempts were counted by the step that scored it
                counts["reward_cache_hits"] += 1
            elif "attempts" in part:
                counts["reward_failed_attempts"] += part["attempts"] - (0 if "dropped" in part else 1)
    return counts


def write_ledger(run_dir: Path, step: int, identity: list[dict[str, str]], samples: Sequence[SampleReward]) -> Path:
    """Append the step's rewards to <run dir>/rewards/step_NNNNNN.jsonl: a line naming the scorers, then one per
    sample with its reward (or drop reason) and each part's call id, replica, attempts and cache use."""
    path = Path(run_dir) / "rewards" / f"step_{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": step, "scorers": identity}, sort_keys=True)]
    lines += [json.dumps({"sample_id": s.item_id, "reward": s.reward, "dropped": s.dropped, "parts": s.parts},
                         sort_keys=True) for s in samples]
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path
