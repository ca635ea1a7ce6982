"""Streaming async RL: per-token admission and staleness (pure), folding paused rounds of a rollout, and
the gate that keeps Generate calls and weight syncs apart (asyncio logic with a stand-in pause)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.coordinator.run.streaming import admit, merge_round, nearest_rank, token_staleness_metrics, token_versions
from services.coordinator.run.streaming_step import GenerationGate


def traj(versions: list[int], *, version: int | None = None, tokens: int | None = None) -> pb.Trajectory:
    n = len(versions) if tokens is None else tokens
    return pb.Trajectory(policy_version=versions[0] if version is None else version,
                         response_token_ids=ids_to_proto(list(range(n))), token_policy_versions=versions)


def test_a_trajectory_without_token_versions_is_all_of_its_version():
    assert token_versions(traj([], version=3, tokens=4)) == [3, 3, 3, 3]
    assert token_versions(traj([1, 2, 2])) == [1, 2, 2]


@pytest.mark.parametrize("k", [1, 2])
def test_admission_keeps_trajectories_whose_every_token_is_within_the_bound(k):
    step = 6  # trainer at 5: admitted versions 5 - k .. 5
    candidates = [traj([5 - k] * 3), traj([5 - k, 5, 5]), traj([4 - k, 5, 5]), traj([5, 6]), traj([5 - k - 1])]
    kept, dropped = admit(step, candidates, k)
    assert kept == candidates[:2] and dropped == 3


def test_admission_at_the_run_start_floors_at_version_zero():
    kept, dropped = admit(1, [traj([0, 0]), traj([0, 1])], 2)
    assert len(kept) == 1 and dropped == 1


def test_token_staleness_is_over_tokens_not_trajectories():
    # step 5 (trainer at 4): one long trajectory of stale tokens and a short fresh one
    m = token_staleness_metrics(5, [traj([3] * 19 + [4]), traj([4])])
    assert m == {"token_staleness_p50": 1.0, "token_staleness_p95": 1.0, "token_staleness_max": 1.0}
    m = token_staleness_metrics(5, [traj([2, 3, 3] + [4] * 17)])
    assert (m["token_staleness_p50"], m["token_staleness_p95"], m["token_staleness_max"]) == (0.0, 1.0, 2.0)
    assert [nearest_rank([1, 2, 3, 4], q) for q in (0.25, 0.5, 0.95, 1.0)] == [1, 2, 4, 4]


def sample(sid: str, reason: str, versions: list[int]) -> pb.Sample:
    return pb.Sample(sample_id=sid, group_id=sid.split("/")[0], finish_reason=reason, policy_versions=versions)


def test_merge_keeps_finished_samples_and_continues_paused_ones():
    done, paused = {}, {}
    merge_round(done, paused, [sample("g/0", "stop", [0, 0]), sample("g/1", "paused", [0]),
                               sample("g/2", "paused", [])])
    assert set(done) == {"g/0"} and set(paused) == {"g/1"}  # g/2 had no token yet: it starts again
    # An answer for a sample finished earlier (none is asked for again) is ignored.
    merge_round(done, paused, [sample("g/0", "stop", [1]), sample("g/1", "length", [0, 1]),
                               sample("g/2", "stop", [1, 1])])
    assert list(done["g/0"].policy_versions) == [0, 0] and list(done["g/1"].policy_versions) == [0, 1]
    assert set(done) == {"g/0", "g/1", "g/2"} and paused == {}


def test_a_sync_pauses_the_calls_in_flight_and_holds_new_ones_until_it_is_done():
    async def scenario():
        log: list[str] = []
        release = asyncio.Event()

        async def pause():
            log.append("pause")
            release.set()  # the engine returns at its next token boundary

        gate = GenerationGate(pause)

        async def generate(name: str, wait: bool):
            async with gate.generating():
                log.append(f"{name} start")
                if wait:
                    await release.wait()
                log.append(f"{name} end")

        async def sync():
            async with gate.syncing():
                log.append("sync")

        first = asyncio.create_task(generate("a", True))
        await asyncio.sleep(0)
        syncer = asyncio.create_task(sync())
        await asyncio.sleep(0)
        second = asyncio.create_task(generate("b", False))
        await asyncio.gather(first, syncer, second)
        return log

    log = asyncio.run(scenario())
    assert log.index("pause") < log.index("a end") < log.index("sync") < log.index("b start"), log


def at_step(t: pb.Trajectory, step: int) -> pb.Trajectory:
    copy = pb.Trajectory.FromString(t.SerializeToString())
    copy.step = step
    return copy


def test_a_streamed_rollout_is_paused_by_a_sync_and_continued_under_the_new_weights(tmp_path):
    """The coordinator's StreamGenerator against the real rollout servicer and torch engine over gRPC: a
    weight sync inside the gate pauses the Generate in flight, the sync applies version 1 (another model's
    weights), and the rollout is sent again with its paused samples as `resumed`. Every kept trajectory
    runs to its length, its tokens of version 0 and then of version 1, its first tokens the ones sampled
    before the pause; and (true_on_policy) every token's log-prob is bitwise what a trainer holding that
    token's version computes."""
    import json
    import logging

    import grpc
    import torch
    from prometheus_client import CollectorRegistry
    from safetensors.torch import load_file

    from contract.wire_tensors import array_from_proto
    from proto import lockstep_pb2_grpc as pb_grpc
    from services.common.auth import BearerToken, generate_token
    from services.common.metric_defs import ROLLOUT_METRICS, build_collectors
    from recipes.tiny_model import build_model_dir
    from services.coordinator.clients import RolloutClient
    from services.coordinator.state.event_log import EventLog
    from services.coordinator.state.exporter import CoordinatorExporter
    from services.coordinator.fleet import RolloutFleet
    from services.coordinator.state.kept_rollouts import KeptRollouts
    from services.coordinator.run.prompts import SamplingPlan
    from services.coordinator.run.fixed_lag import BusyIntervals
    from services.coordinator.run.streaming_step import StreamGenerator
    from services.coordinator.tasks.base import Problem
    from services.rollout.config import RolloutServiceConfig
    from services.rollout.server import RolloutServicer
    from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
    from services.trainer.trainer import Trainer
    from services.trainer.data.wire import StepRequest, decode_trajectory
    from tests.rollout.decoder_support import TINY

    models = [build_model_dir(tmp_path / f"v{v}", TINY, seed=3 + v) for v in (0, 1)]
    prompts = {"p0": [5, 9, 2, 13], "p1": [7]}
    torch.set_num_threads(1)
    engine = TorchEngine(TorchEngineConfig(max_batch_size=4, numerics="true_on_policy"))
    engine.load(str(models[0]), 0)
    token = BearerToken(generate_token())

    async def scenario():
        servicer = RolloutServicer(RolloutServiceConfig(), build_collectors(ROLLOUT_METRICS, CollectorRegistry()),
                                   token)
        servicer.engine, servicer.engine_name, servicer.run_id = engine, "torch", "r"
        server = grpc.aio.server()
        pb_grpc.add_RolloutServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = RolloutClient(f"127.0.0.1:{port}", 60.0, token)

        async def not_cancelled() -> None:
            return None

        # No store: the happy path records no event (a recorded one would fail the test loudly).
        events = EventLog("r", None, CoordinatorExporter(), logging.getLogger("test.streaming"))
        fleet = RolloutFleet("r", None, [client], "unused", events, generate_retries=0, recovery_timeout_s=0.0,
                             check_cancelled=not_cancelled)
        kept = KeptRollouts("r", tmp_path / "rollouts", model_path=str(models[0]), seed=0)
        gate = GenerationGate(lambda: client.pause_generation("r"))
        problems = [Problem(pid, "", "") for pid in prompts]
        plan = SamplingPlan(pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=100), 2, ("s", 0, 1))

        async def score(step, samples, lost):
            return [pb.Trajectory(run_id="r", step=step, policy_version=s.policy_versions[0], group_id=s.group_id,
                                  sample_id=s.sample_id, response_token_ids=s.response_token_ids,
                                  prompt_token_ids=ids_to_proto(prompts[problems[i].problem_id]),
                                  rollout_logprobs=s.logprobs, token_policy_versions=s.policy_versions,
                                  finish_reason=s.finish_reason) for i, s in samples], {"lost": lost}

        original, rounds, asked = fleet.generate, [], []

        async def recording_generate(*args, **kwargs):
            got, dropped = await original(*args, **kwargs)
            rounds.append([s for _, s in got])
            asked.append(set(kwargs["only"]))
            return got, dropped

        fleet.generate = recording_generate
        # What the generator reads of the run's StepContext.
        context = SimpleNamespace(fleet=fleet, kept=kept, spec=SimpleNamespace(steps=1),
                                  problems=lambda t: problems, training_plan=lambda t: plan,
                                  tokens=SimpleNamespace(encode=lambda p: prompts[p.problem_id]),
                                  score_rollout=score, replicas_at=0)
        generator = StreamGenerator(context, gate, BusyIntervals())
        try:
            generator.start(1)
            await generator.advance(1)
            await asyncio.to_thread(engine._generating.wait, 30)
            async with gate.syncing():
                engine.update_weights(load_file(str(models[1] / "model.safetensors")), 1)
                context.replicas_at = 1
            await generator.ready(1)
        finally:
            await generator.stop()
            await client.close()
            await server.stop(None)
            servicer.close()
        return kept.get(1), rounds, asked

    (trajectories, counts), rounds, asked = asyncio.run(scenario())
    assert counts == {"lost": 0} and len(trajectories) == 4 and len(rounds) == 2
    # The first round asks for every sample; the second for those still missing (here all four were paused).
    assert asked == [set(), {s.sample_id for s in rounds[0]}]
    assert {s.finish_reason for s in rounds[0]} == {"paused"}
    before = {s.sample_id: array_from_proto(s.response_token_ids, field="t").tolist() for s in rounds[0]}
    for t in trajectories:
        ids = array_from_proto(t.response_token_ids, field="t").tolist()
        n0 = len(before[t.sample_id])
        assert len(ids) == 100 and t.finish_reason == "length"
        assert list(t.token_policy_versions) == [0] * n0 + [1] * (100 - n0)
        assert ids[:n0] == before[t.sample_id]
    config = json.dumps({"numerics": "true_on_policy", "temperature": 1.0, "parity_gate": {"worst_tokens": 1000}})
    prompt_len = {t.sample_id: len(prompts["p0" if t.group_id.endswith("g0") else "p1"]) for t in trajectories}
    for v, model in enumerate(models):
        trainer = Trainer(device="cpu", num_threads=1)
        trainer.configure(run_id="r", model_path=str(model), seed=0, config_json=config)
        header = pb.TrainStepHeader(run_id="r", step=2, policy_version=0, max_staleness=1, streaming=True)
        # Scored as step 2's (the trainer at version 1 admits tokens of versions 0 and 1).
        samples = [decode_trajectory(at_step(t, 2), i, header) for i, t in enumerate(trajectories)]
        scored = {(w.sample_id, w.position): (w.logp, w.rollout_logp)
                  for w in trainer.check_parity(StepRequest("r", 2, 0, samples)).worst}
        mine, others = [], []
        for t in trajectories:
            for j, tv in enumerate(t.token_policy_versions):
                (mine if tv == v else others).append((t.sample_id, prompt_len[t.sample_id] + j))
        assert len(mine) + len(others) == 400 and set(mine) | set(others) <= set(scored)
        assert all(scored[k][0] == scored[k][1] for k in mine), v
        # ... and not what the other version computes: the check can tell the versions apart.
        assert not others or any(scored[k][0] != scored[k][1] for k in others), v
