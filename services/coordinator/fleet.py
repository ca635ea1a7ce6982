"""The run's rollout replicas as one fleet: dispatching a step's prompts over the live ones, evicting
a replica that stops answering and readmitting it once it answers again at the run's weights,
reloading one that was restarted behind the run's back, and syncing weights after each train step.

Weights never pass through the coordinator: a stale replica is told to pull a version from the
trainer (SyncWeights), to read the directory the trainer wrote (shared_path), or to join the group the
trainer broadcasts it over (broadcast), and reports the digest it verified; replicas reporting different digests for
one version did not get the same weights, and the run fails. Which replicas are in service is the
pure bookkeeping of replicas.ReplicaPool; this module does the I/O around it."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient, TrainerUnavailable, is_unavailable
from services.coordinator.replicas import ReplicaPool
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.prompts import SamplingPlan, group_id
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.event_log import EventLog
from services.coordinator.tasks import Problem
from services.coordinator.ipc_weights import IpcWeights
from services.coordinator.weight_sources import BroadcastWeights, SharedPathWeights, judge_round, rpc_details

Encode = Callable[[Problem], list[int]]


@dataclass
class Shard:
    """Prompts sent to one replica in one Generate call."""

    problems: list[Problem]
    indices: list[int]  # index of each problem within the step (its group id and seed derive from it)
    positions: list[int]  # position of each problem in the generate() call's list
    resumed: list[pb.ResumedSample]  # paused samples of these problems, continued rather than started again
    sample_ids: list[str]  # non-empty: only these samples of the problems are generated

    def samples_asked(self, samples_per_prompt: int) -> int:
        """How many samples the shard's Generate call asks for (what is dropped if it is never answered)."""
        return len(self.sample_ids) or len(self.problems) * samples_per_prompt


class RolloutFleet:
    def __init__(self, run_id: str, spec: RunSpec, clients: Sequence[RolloutClient], weights_address: str,
                 events: EventLog, *, generate_retries: int, recovery_timeout_s: float,
                 check_cancelled: Callable[[], Awaitable[None]],
                 shared_weights: SharedPathWeights | None = None,
                 broadcast_weights: BroadcastWeights | None = None, ipc_weights: IpcWeights | None = None) -> None:
        self.run_id, self.spec = run_id, spec
        self.pool = ReplicaPool(clients)
        self.weights_address = weights_address  # where replicas pull the trainer's weights from
        self.shared_weights = shared_weights  # rollout.weight_sync shared_path: the directories the trainer writes
        self.broadcast_weights = broadcast_weights  # rollout.weight_sync broadcast: one group per sync
        self.ipc_weights = ipc_weights  # rollout.weight_sync ipc/auto: one handover per sync, once chosen
        self.events = events
        self.generate_retries = generate_retries
        self.recovery_timeout_s = recovery_timeout_s
        self.check_cancelled = check_cancelled
        self._recovery = asyncio.Lock()  # concurrent shards wait for one recovery, not one each
        self._reloads: dict[str, int] = {}  # replica address -> times it was found restarted and reloaded

    # ------------------------------------------------------------ service --
    async def start_at(self, version: int) -> list[RolloutClient]:
        """Bring every replica to `version` (evicting the unreachable); the live ones. NoLiveReplica if
        none comes up within the recovery timeout."""
        for client in self.pool.all():
            try:
                await self.bring_up_to_date(client, version)
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self.evict(client, step=0, reason=f"unreachable at run start ({exc.code()})")
        await self.await_live(0, version)
        self.export_counts(self.events.exporter)
        return self.pool.live()

    def export_counts(self, exporter) -> None:
        exporter.replicas_live(self.run_id, len(self.pool.live()), len(self.pool.all()))

    async def bring_up_to_date(self, client: RolloutClient, version: int) -> None:
        """Load this run's model on `client` if it holds another, then have it pull `version` from the
        trainer unless it holds it already."""
        rinfo = await client.info()
        # Reload when the replica holds another run, nothing, or a version ahead
        # of the trainer (which came back from an older checkpoint): engines
        # refuse to step a version back, so it starts again from the model.
        if rinfo.run_id != self.run_id or not 0 <= rinfo.policy_version <= version:
            engine_json = json.dumps({"engine": self.spec.rollout.engine, **self.spec.rollout.engine_options})
            await client.load_model(self.run_id, self.spec.model_path, 0, engine_json)
            rinfo = await client.info()
        if rinfo.policy_version != version:
            await self.pull_weights(client, version)

    @property
    def ipc_active(self) -> bool:
        return self.ipc_weights is not None and self.ipc_weights.active

    @property
    def weight_source(self) -> str:
        """The source the run's syncs use now ('auto' resolved once the services are configured)."""
        return "ipc" if self.ipc_active else self.spec.rollout.non_ipc_source

    async def pull_weights(self, client: RolloutClient, version: int) -> pb.UpdateWeightsResponse:
        """The replica streams `version` from the trainer itself (SyncWeights), or reads the directory the
        trainer wrote (shared_path): the weights' bytes never pass through the coordinator."""
        if self.ipc_active:
            got = (await self.ipc_weights.sync([client], version, self.weights_address))[0]
            if isinstance(got, BaseException):
                raise got
        elif self.broadcast_weights is not None:
            # A replica found behind on its own (restarted, readmitted, run start) gets a group of its own.
            got = await self._broadcast_alone(client, version)
        elif self.shared_weights is not None:
            got = await self.shared_weights.load(client, version)
        else:
            got = await client.sync_weights(self.run_id, version, self.weights_address)
        if got.policy_version != version:
            raise RunFailed(f"replica {client.address} reports version {got.policy_version} after sync, expected {version}")
        return got

    async def evict(self, client: RolloutClient, *, step: int, reason: str) -> None:
        if self.pool.evict(client):
            await self.events.record("replica_evicted", "rollout replica evicted", export=self.export_counts,
                                     step=step, replica=client.address, reason=reason, live=len(self.pool.live()))

    async def readmit(self, step: int, version: int) -> None:
        """Probe each evicted replica; one that answers is brought to `version` and put back in service."""
        for client in self.pool.evicted():
            try:
                await client.health()
                await self.bring_up_to_date(client, version)
            except Exception as exc:
                if is_unavailable(exc):
                    continue  # still down: probed again before the next step
                raise
            self.pool.readmit(client)
            await self.events.record("replica_readmitted", "rollout replica readmitted", export=self.export_counts,
                                     step=step, replica=client.address, policy_version=version,
                                     live=len(self.pool.live()))

    async def await_live(self, step: int, version: int) -> None:
        """With no live replica, wait up to the recovery timeout for an evicted one to answer again
        (restarted by its supervisor), bring it to `version` and readmit it; NoLiveReplica if none does."""
        async with self._recovery:
            if self.pool.live():
                return
            timeout = self.recovery_timeout_s
            deadline, delay = time.monotonic() + timeout, 0.5
            while True:
                await self.check_cancelled()
                await self.readmit(step, version)
                if self.pool.live():
                    return
                if time.monotonic() + delay > deadline:
                    self.pool.require_live(f"step {step} (waited {timeout:.0f} s for one to come back)")
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    async def reload_if_restarted(self, client: RolloutClient, info: pb.ServiceInfo | None, *, step: int,
                                  version: int) -> bool:
        """A replica that answers but holds no model at all was restarted since it last served the run:
        load the run's model and weights at `version`. False (nothing done) for one holding a model.
        `info` None: ask the replica (under the recovery lock, so concurrent shards reload it once)."""
        async with self._recovery:
            info = info if info is not None else await client.info()
            if info.run_id or info.policy_version >= 0:
                return False
            await self.bring_up_to_date(client, version)
            self._reloads[client.address] = self._reloads.get(client.address, 0) + 1
        await self.events.record("replica_reloaded", "restarted rollout replica reloaded",
                                 step=step, replica=client.address, policy_version=version)
        return True

    # ------------------------------------------------------------ weights --
    async def sync_weights(self, version: int) -> None:
        """Every live replica at `version` after a train step: restarted ones reloaded, stale ones synced,
        unreachable ones evicted; waits for one to come back if none is left."""
        stale = []
        for client in self.pool.live():
            try:
                info = await client.info()
                if not await self.reload_if_restarted(client, info, step=version, version=version) \
                        and info.policy_version != version:
                    stale.append(client)
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self.evict(client, step=version, reason=f"unreachable before weight sync ({exc.code()})")
        if stale:
            await self.sync_replicas(stale, version)
        await self.await_live(version, version)

    async def sync_replicas(self, clients: Sequence[RolloutClient], version: int) -> None:
        """Every stale replica pulls `version` at once; one that is unreachable is evicted. Each verified
        its stream against the digest the trainer computed while sending it; replicas that report
        different digests for one version did not get the same weights, and the run fails. A trainer
        that aborts the stream (it lost the run's state) is TrainerUnavailable."""
        if self.broadcast_weights is not None and not self.ipc_active:
            synced = await self._broadcast_to(clients, version)
        else:
            if self.ipc_active:  # one handover for every stale replica
                results = await self.ipc_weights.sync(clients, version, self.weights_address)
            else:
                results = await asyncio.gather(*(self.pull_weights(c, version) for c in clients),
                                               return_exceptions=True)
            synced = {}
            for c, r in zip(clients, results):
                if isinstance(r, BaseException):
                    if not is_unavailable(r):
                        raise r
                    await self.evict(c, step=version, reason=f"weight sync failed ({r.code()})")
                elif r.policy_version != version:
                    raise RunFailed(f"replica {c.address} reports version {r.policy_version} after sync, "
                                    f"expected {version}")
                else:
                    synced[c.address] = r
        digests = {address: r.total_sha256 or f"engine:{r.engine_checksum}" for address, r in synced.items()}
        if len(set(digests.values())) > 1:
            raise RunFailed(f"step {version}: replicas report different weight digests for one version: {digests}")
        if synced:
            first = next(iter(synced.values()))
            await self.events.record("weights_synced", "weights synced", policy_version=version,
                                     source=self.weight_source,
                                     digest=digests[next(iter(synced))], bytes=first.bytes, replicas=sorted(synced),
                                     prefetched=sorted(a for a, r in synced.items() if r.prefetched))

    async def _broadcast_to(self, clients: Sequence[RolloutClient], version: int) -> dict[str, pb.UpdateWeightsResponse]:
        """One group of every stale replica. Replicas that turn out unreachable are evicted; when that broke
        the broadcast, the others are synced again in a fresh group of their own (once, recorded as
        weight_broadcast_regrouped). Any other failure fails the run (judge_round decides)."""
        for attempt in range(2):
            done = await self.broadcast_weights.round(clients, version)
            verdict = judge_round(done, may_regroup=attempt == 0)
            for i in verdict.evict:
                await self.evict(clients[i], step=version,
                                 reason=f"weight broadcast failed ({done.received[i].code()})")
            if verdict.failure is not None:
                raise verdict.failure
            if not verdict.regroup:
                return {clients[i].address: self._verified(clients[i], done.received[i], done.sent, version)
                        for i in verdict.accept}
            await self.events.record("weight_broadcast_regrouped", "weight broadcast retried without unreachable "
                                     "replicas", step=version, policy_version=version,
                                     dropped=sorted(clients[i].address for i in verdict.evict),
                                     replicas=sorted(clients[i].address for i in verdict.regroup))
            clients = [clients[i] for i in verdict.regroup]
        raise AssertionError("judge_round regroups only on the first attempt")

    def _verified(self, client: RolloutClient, got: pb.UpdateWeightsResponse | BaseException,
                  sent: pb.UpdateWeightsResponse, version: int) -> pb.UpdateWeightsResponse:
        """A replica's answer to a broadcast that went through: it must report the trainer's digest, or, for
        an engine that cannot hash what it received (SGLang), a checksum of what it serves (which the
        replicas of one version must then agree on)."""
        if isinstance(got, BaseException):
            raise got
        if not self.broadcast_weights.digest_trailer and got.policy_version == version and got.engine_checksum \
                and not got.total_sha256:
            return got
        if got.policy_version != version or got.total_sha256 != sent.total_sha256:
            raise RunFailed(f"step {version}: replica {client.address} reports version {got.policy_version} digest "
                            f"{got.total_sha256!r} after the broadcast; the trainer sent version {sent.policy_version} "
                            f"digest {sent.total_sha256!r}")
        return got

    async def _broadcast_alone(self, client: RolloutClient, version: int) -> pb.UpdateWeightsResponse:
        done = await self.broadcast_weights.round([client], version)
        if isinstance(done.received[0], BaseException):
            raise done.received[0]  # an unreachable replica is evicted by the caller
        if isinstance(done.sent, BaseException):
            raise done.sent if isinstance(done.sent, TrainerUnavailable) else RunFailed(
                f"weight broadcast {done.plan.group_name} to {client.address} failed: {rpc_details(done.sent)}")
        got = self._verified(client, done.received[0], done.sent, version)
        await self.events.record("weights_caught_up", "replica brought up to date in a group of its own",
                                 policy_version=version, replica=client.address,
                                 digest=got.total_sha256 or f"engine:{got.engine_checksum}",
                                 group_name=done.plan.group_name)
        return got

    # ----------------------------------------------------------- generate --
    async def generate(self, problems: list[Problem], plan: SamplingPlan, encode: Encode, *, step: int,
                       policy_version: int, first_index: int = 0, indices: Sequence[int] | None = None,
                       resumed: Sequence[pb.Sample] = (), only: Collection[str] = (),
                       on_shard: Callable[[list[tuple[int, pb.Sample]]], None] | None = None
                       ) -> tuple[list[tuple[int, pb.Sample]], int]:
        """Samples as (index in `problems`, sample) in problem order; returns also the dropped count.

        `first_index` numbers the problems within the step (group ids and sampling seeds derive from
        it), so further rounds of one step never reuse a group id or a seed; `indices` numbers them one
        by one instead. `resumed`: paused samples of these problems, continued from their tokens. `only`:
        non-empty, the sample ids to generate (every resumed one among them), not every sample of each
        problem; the dropped count then counts the samples asked for. `on_shard`: called with each shard's
        samples (as returned) as soon as its replica answers, while the other shards are still generating."""
        await self.await_live(step, policy_version)
        indices = list(range(first_index, first_index + len(problems))) if indices is None else list(indices)
        n = len(self.pool.live())
        size = -(-len(problems) // n)
        paused: dict[str, list[pb.ResumedSample]] = {}
        for r in resumed:
            paused.setdefault(r.group_id, []).append(pb.ResumedSample(
                sample_id=r.sample_id, response_token_ids=r.response_token_ids, logprobs=r.logprobs,
                policy_versions=r.policy_versions))
        shards = [Shard(problems[i:i + size], indices[i:i + size], list(range(i, min(i + size, len(problems)))),
                        [r for k in indices[i:i + size] for r in paused.get(group_id(step, k), [])],
                        [sample_id for k in indices[i:i + size] for j in range(plan.samples_per_prompt)
                         if (sample_id := f"{group_id(step, k)}/{j}") in only])
                  for i in range(0, len(problems), size)]
        exporter = self.events.exporter
        exporter.queue_depth(self.run_id, len(problems))
        async def generate_shard(shard: Shard, k: int) -> pb.GenerateResponse | None:
            res = await self._generate_shard(shard, k, plan, encode, step=step, policy_version=policy_version)
            if res is not None and on_shard is not None:
                gids = {group_id(step, i): position for i, position in zip(shard.indices, shard.positions)}
                on_shard([(gids[s.group_id], s) for s in res.samples])
            return res

        results = await asyncio.gather(*(generate_shard(shard, k) for k, shard in enumerate(shards)))
        exporter.queue_depth(self.run_id, 0)
        out: list[tuple[int, pb.Sample]] = []
        dropped = 0
        for shard, res in zip(shards, results):
            if res is None:
                dropped += shard.samples_asked(plan.samples_per_prompt)
                continue
            gids = {group_id(step, k): position for k, position in zip(shard.indices, shard.positions)}
            for s in res.samples:
                out.append((gids[s.group_id], s))
        return out, dropped

    async def _check_version(self, response: pb.GenerateResponse, client: RolloutClient, *, step: int,
                             policy_version: int) -> None:
        """Every sample of a step must come from the version the step was dispatched at (step - 1, or the
        fixed_lag version): a replica that reports another is refused, recorded, and the run fails before
        anything of the step is trained."""
        if response.policy_version == policy_version:
            return
        await self.events.record("rollout_version_refused", "rollout replica reported the wrong policy version",
                                 step=step, replica=client.address, reported=response.policy_version,
                                 expected=policy_version)
        raise RunFailed(f"step {step}: replica {client.address} reports samples of policy version "
                        f"{response.policy_version}; the step's rollout must come from version {policy_version}")

    async def _generate_shard(self, shard: Shard, replica: int, plan: SamplingPlan, encode: Encode, *,
                              step: int, policy_version: int) -> pb.GenerateResponse | None:
        if plan.episode is None:
            prompts = [
                pb.Prompt(group_id=group_id(step, k), token_ids=ids_to_proto(encode(p)), seed=plan.seed(k))
                for k, p in zip(shard.indices, shard.problems)
            ]
        else:  # the environment writes the prompt from the problem (and rewards against its answer)
            prompts = [
                pb.Prompt(group_id=group_id(step, k), seed=plan.seed(k),
                          problem=pb.EpisodeProblem(problem_id=p.problem_id, prompt=p.prompt, answer=p.answer))
                for k, p in zip(shard.indices, shard.problems)
            ]
        request = pb.GenerateRequest(
            run_id=self.run_id, step=step, policy_version=policy_version, prompts=prompts,
            samples_per_prompt=plan.samples_per_prompt, sampling=plan.params, resumed=shard.resumed,
            episode=plan.episode, sample_ids=shard.sample_ids,
        )
        attempts = self.generate_retries + 1
        for attempt in range(attempts):
            await self.await_live(step, policy_version)
            candidates = self.pool.live()
            client = candidates[(replica + attempt) % len(candidates)]
            reloads = self._reloads.get(client.address, 0)
            try:
                try:
                    response = await client.generate(request)
                except Exception as exc:
                    # A refusal from a replica that lost its model (restarted between two calls) is
                    # answered by reloading it -- here, or by a concurrent shard meanwhile; any other
                    # refusal fails the run.
                    if is_unavailable(exc):
                        raise
                    if not await self.reload_if_restarted(client, None, step=step, version=policy_version) \
                            and self._reloads.get(client.address, 0) == reloads:
                        raise
                    continue
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                await self.evict(client, step=step, reason=f"generate failed ({exc.code()})")
                await self.events.record("generate_redispatched", "rollout replica unavailable; re-dispatching",
                                         step=step, replica=client.address, attempt=attempt + 1,
                                         reason=str(exc.code()))
                await asyncio.sleep(min(2.0 ** attempt, 10.0))
            else:
                await self._check_version(response, client, step=step, policy_version=policy_version)
                return response
        await self.events.record("trajectories_dropped", "trajectories dropped: rollout unavailable", step=step,
                                 count=shard.samples_asked(plan.samples_per_prompt),
                                 reason=f"rollout unavailable after {attempts} attempts")
        return None
