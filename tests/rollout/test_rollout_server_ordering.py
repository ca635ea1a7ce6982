"""Weights change only between batches: UpdateWeights waits for a Generate in flight.

In-process servicer with a recording engine whose generate blocks until
released, so the interleaving is forced rather than hoped for.
"""
from __future__ import annotations

import asyncio
import threading

import torch
from prometheus_client import CollectorRegistry

from proto import lockstep_pb2 as pb
from services.common.auth import BearerToken, generate_token
from services.common.metric_defs import ROLLOUT_METRICS, build_collectors
from services.common.tensors import ids_to_proto
from services.common.weights.stream import iter_weight_chunks
from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import Engine
from services.rollout.server import RolloutServicer
from services.rollout.types import GeneratedSample, GenerationRequest


class RecordingEngine(Engine):
    name = "recording"

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()
        self._version = 0

    @classmethod
    def from_config_json(cls, text: str, service=None) -> "RecordingEngine":
        return cls()

    def load(self, model_path: str, policy_version: int) -> None:
        self._version = policy_version

    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        self.events.append(f"generate start v{self._version}")
        self.started.set()
        assert self.release.wait(10)
        self.events.append(f"generate end v{self._version}")
        return [GeneratedSample(p.group_id, i, [1], [-0.5], "length")
                for p in request.prompts for i in range(request.samples_per_prompt)]

    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int, *,
                       finite_checked: bool = False) -> None:
        self.events.append(f"update v{policy_version}")
        self._version = policy_version

    @property
    def policy_version(self) -> int:
        return self._version


class Context:
    async def abort(self, code, details):  # pragma: no cover - a failure path here fails the test
        raise AssertionError(f"aborted: {code} {details}")


def test_update_waits_for_the_batch_in_flight():
    async def scenario() -> list[str]:
        servicer = RolloutServicer(RolloutServiceConfig(), build_collectors(ROLLOUT_METRICS, CollectorRegistry()),
                                   BearerToken(generate_token()))
        engine = RecordingEngine()
        servicer.engine, servicer.engine_name, servicer.run_id = engine, "recording", "r"
        req = pb.GenerateRequest(
            run_id="r", policy_version=0, samples_per_prompt=1,
            prompts=[pb.Prompt(group_id="g", token_ids=ids_to_proto([1, 2]), seed=0)],
            sampling=pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1),
        )
        gen = asyncio.create_task(servicer.Generate(req, Context()))
        await asyncio.to_thread(engine.started.wait, 10)

        async def chunks():
            for c in iter_weight_chunks([("w", torch.ones(4))], run_id="r", policy_version=1):
                yield c

        upd = asyncio.create_task(servicer.UpdateWeights(chunks(), Context()))
        await asyncio.sleep(0.2)
        health = await servicer.Health(pb.HealthRequest(), Context())
        assert health.status == "busy"
        assert engine.events == ["generate start v0"]  # the update has not touched the engine
        engine.release.set()
        resp, up = await gen, await upd
        assert resp.policy_version == 0 and up.policy_version == 1
        servicer.close()
        return engine.events

    assert asyncio.run(scenario()) == ["generate start v0", "generate end v0", "update v1"]
