"""The scorer replicas serving one reward source of a run (a reward model or a judge): loading the model on
each, agreeing on what was loaded, and one checked Score call.

A replica that cannot be reached is taken out of service for the run (as a rollout replica is) and probed
again before the next step; a replica whose weights digest differs from the others' fails the run, since
its scores would be another model's. Every answer is checked against its request here (one result per
item, in order, the call's own id echoed) and each item's verdict or score read by verdicts.py.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from contract.judge_template import template_sha256
from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient, is_unavailable
from services.coordinator.rewards.spec import JudgeSpec, RewardModelSpec
from services.coordinator.rewards.verdicts import ScoreRefused, check_score, read_verdict
from services.coordinator.run.errors import RunFailed


@dataclass(frozen=True)
class ScoreInput:
    item_id: str
    prompt: str
    response: str
    reference: str


@dataclass(frozen=True)
class CallResult:
    """One Score call: each item's score, or why it got none, and the call's id and replica."""

    call_id: str
    replica: str
    outcomes: dict[str, float | ScoreRefused]
    verdicts: dict[str, str]
    seconds: float


class ScorerGroup:
    """The replicas of one source. `identity` is set once start() agreed on the loaded weights."""

    def __init__(self, run_id: str, source: str, spec: RewardModelSpec | JudgeSpec,
                 clients: Sequence[RolloutClient], timeout_s: float) -> None:
        if not clients:
            raise RunFailed(f"reward.{source}: no scorer replica to serve it")
        self.run_id, self.source, self.spec, self.timeout_s = run_id, source, spec, timeout_s
        self.clients = list(clients)
        self.evicted: set[str] = set()
        self.identity: dict[str, str] = {}
        self._busy = {c.address: asyncio.Lock() for c in self.clients}  # one call at a time per replica
        self._calls = 0

    @property
    def judge(self) -> bool:
        return isinstance(self.spec, JudgeSpec)

    def live(self) -> list[RolloutClient]:
        return [c for c in self.clients if c.address not in self.evicted]

    def engine_json(self) -> str:
        return json.dumps({"engine": self.spec.engine, **self.spec.engine_options})

    async def start(self) -> dict[str, str]:
        """Load the source's model on every replica not yet holding it for this run; evict the unreachable;
        the identity (model path, weights digest, template hash) the live ones agree on. RunFailed if none
        is live or two disagree."""
        digests: dict[str, str] = {}
        for client in self.clients:
            try:
                digests[client.address] = await self._loaded_digest(client)
            except grpc.aio.AioRpcError as exc:
                if not is_unavailable(exc):
                    raise RunFailed(f"reward.{self.source}: scorer {client.address} refused the model: "
                                    f"{exc.code().name}: {exc.details()}") from None
                self.evicted.add(client.address)
            else:
                self.evicted.discard(client.address)
        if not digests:
            raise RunFailed(f"reward.{self.source}: no scorer replica answers "
                            f"({', '.join(c.address for c in self.clients)})")
        if len(set(digests.values())) > 1:
            raise RunFailed(f"reward.{self.source}: scorer replicas loaded different weights: {digests}")
        self.identity = {"source": self.source, "model_path": self.spec.model_path,
                         "weights_sha256": next(iter(digests.values())), "engine": self.spec.engine}
        if self.judge:
            self.identity["template_sha256"] = template_sha256(self.spec.template)
        return self.identity

    async def _loaded_digest(self, client: RolloutClient) -> str:
        info = await client.info()
        if info.details.get("role") != "scorer":
            raise RunFailed(f"reward.{self.source}: replica {client.address} is not a scorer (role "
                            f"{info.details.get('role', '?')!r})")
        if info.run_id != self.run_id or info.model_path != self.spec.model_path or not info.details.get(
                "weights_sha256") or info.details.get("engine") != self.spec.engine:
            info = await client.load_model(self.run_id, self.spec.model_path, 0, self.engine_json())
        digest = info.details.get("weights_sha256", "")
        if not digest:
            raise RunFailed(f"reward.{self.source}: scorer {client.address} reports no weights digest")
        if self.identity and digest != self.identity["weights_sha256"]:
            raise RunFailed(f"reward.{self.source}: scorer {client.address} now serves weights {digest}, not the "
                            f"run's {self.identity['weights_sha256']}")
        return digest

    async def readmit(self) -> None:
        """Probe each evicted replica; one that answers again is loaded (if it lost the model) and readmitted."""
        for client in [c for c in self.clients if c.address in self.evicted]:
            try:
                await self._loaded_digest(client)
            except grpc.aio.AioRpcError:
                continue  # still down (or refusing): probed again before the next step
            self.evicted.discard(client.address)

    async def call(self, client: RolloutClient, items: Sequence[ScoreInput], step: int) -> CallResult:
        """One Score call to `client`: every item's score (checked) or ScoreRefused. A call that fails as a
        whole fails each of its items with the call's reason; an unreachable replica is evicted."""
        self._calls += 1
        call_id = f"{self.run_id}/s{step}/{self.source}/{self._calls}"
        request = pb.ScoreRequest(run_id=self.run_id, call_id=call_id, items=[
            pb.ScoreItem(item_id=i.item_id, prompt=i.prompt, response=i.response, reference=i.reference)
            for i in items])
        if self.judge:
            request.judge_template, request.max_new_tokens = self.spec.template, self.spec.max_new_tokens
        async with self._busy[client.address]:  # the deadline covers the call's own work, not a queue
            began = time.monotonic()
            try:
                response = await client.score(request, self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                seconds = time.monotonic() - began
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    why = ScoreRefused("timeout", f"{client.address} did not answer within {self.timeout_s} s")
                elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.evicted.add(client.address)
                    why = ScoreRefused("scorer_unavailable", f"{client.address}: {exc.details()}")
                else:
                    why = ScoreRefused("scorer_error", f"{client.address}: {exc.code().name}: {exc.details()}")
                return CallResult(call_id, client.address, {i.item_id: why for i in items}, {}, seconds)
            seconds = time.monotonic() - began
        return self._read(response, items, call_id, client.address, seconds)

    def _read(self, response: pb.ScoreResponse, items: Sequence[ScoreInput], call_id: str, replica: str,
              seconds: float) -> CallResult:
        expected = [i.item_id for i in items]
        got = [r.item_id for r in response.results]
        digest = self.identity.get("weights_sha256")
        if response.call_id != call_id or got != expected or (digest and response.weights_sha256 != digest):
            why = ScoreRefused("malformed", f"{replica} answered call {response.call_id!r} with "
                               f"{len(got)} results for {len(expected)} items, weights "
                               f"{response.weights_sha256[:16]!r}")
            return CallResult(call_id, replica, {i: why for i in expected}, {}, seconds)
        outcomes: dict[str, float | ScoreRefused] = {}
        verdicts: dict[str, str] = {}
        for result in response.results:
            try:
                if self.judge:
                    verdicts[result.item_id] = result.verdict
                    value = read_verdict(result.verdict, self.spec.parser)
                elif result.verdict:
                    raise ScoreRefused("malformed", "a reward model answered with verdict text")
                else:
                    value = result.score
                outcomes[result.item_id] = check_score(value, self.spec.score_range)
            except ScoreRefused as refused:
                outcomes[result.item_id] = refused
        return CallResult(call_id, replica, outcomes, verdicts, seconds)
