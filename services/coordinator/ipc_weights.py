"""The IPC weight source, coordinator side: whether a run can use it, and one handover per sync.

Whether: every service reports where it runs (ServiceInfo.details: node_id -- the kernel's boot id and IPC
namespace --, hostname, the GPUs it sees, the GPU its weights are on; services/common/weights/ipc_transport.py).
A handover reaches a replica only on the trainer's node (same boot, same IPC namespace), in the torch engine
(which holds its model in its own process), and, for weights on a GPU, only if the replica sees that GPU.
`rollout.weight_sync: ipc` on a fleet where one replica cannot be reached that way fails the run naming the
replica and why; `auto` uses IPC when every replica can, else `rollout.weight_sync_fallback`, and records the
choice and its reason (event weight_source_chosen) each time the services are configured.

One handover per sync: the trainer packs the version once for all the replicas synced (OpenWeightHandover:
the coordinator learns an id, never a handle), each replica fetches, checks, maps, verifies and applies it
itself (MapWeights), and the coordinator closes the handover whatever happened (CloseWeightHandover frees
the buckets and the shares of replicas that never released theirs).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc

from proto import lockstep_pb2 as pb
from services.coordinator.clients import RolloutClient, TrainerClient, TrainerUnavailable, is_unavailable
from services.coordinator.run.errors import RunFailed
from services.coordinator.state.event_log import EventLog


@dataclass(frozen=True)
class SourceChoice:
    source: str  # "ipc" or the fallback
    reason: str


def ipc_blocker(engine: str, trainer: Mapping[str, str], replica: Mapping[str, str], address: str) -> str | None:
    """Pure. Why a handover from this trainer cannot reach this replica, or None when it can."""
    if engine != "torch":
        return f"rollout.engine {engine!r} holds its model in another process (IPC needs the torch engine)"
    if not trainer.get("node_id"):
        return "the trainer reports no node identity (an older trainer)"
    if replica.get("node_id") != trainer["node_id"]:
        where = replica.get("hostname") or "an unreported host"
        return (f"replica {address} runs on {where} (node {replica.get('node_id', '')!r}), the trainer on "
                f"{trainer.get('hostname', '')} (node {trainer['node_id']!r}): not one node and IPC namespace")
    gpu = trainer.get("weights_device_uuid", "")
    if gpu and gpu not in replica.get("device_uuids", "").split(","):
        seen = replica.get("device_uuids") or "none"
        return f"replica {address} does not see the trainer's GPU {gpu} (it sees {seen})"
    return None


def choose_source(configured: str, fallback: str, engine: str, trainer: Mapping[str, str],
                  replicas: Mapping[str, Mapping[str, str]]) -> SourceChoice:
    """Pure. `configured` 'ipc' or 'auto'. RunFailed when 'ipc' cannot reach a replica (naming it and why)."""
    blockers = [b for address, details in sorted(replicas.items())
                if (b := ipc_blocker(engine, trainer, details, address)) is not None]
    if not replicas:
        blockers.append("no replica answered")
    if not blockers:
        gpu = trainer.get("weights_device_uuid") or "host memory"
        return SourceChoice("ipc", f"trainer and every replica on node {trainer['node_id']} ({gpu})")
    if configured == "ipc":
        raise RunFailed(f"rollout.weight_sync: 'ipc' cannot reach the fleet: {'; '.join(blockers)}")
    return SourceChoice(fallback, "; ".join(blockers))


class IpcWeights:
    def __init__(self, trainer: TrainerClient, run_id: str, *, configured: str, fallback: str, engine: str) -> None:
        self.trainer, self.run_id = trainer, run_id
        self.configured, self.fallback, self.engine = configured, fallback, engine
        self.active = False  # set by choose(): every sync of the run goes through a handover

    async def choose(self, clients: Sequence[RolloutClient], events: EventLog) -> SourceChoice:
        """Decide from what the trainer and the reachable replicas report (an unreachable one is the fleet's to
        evict); recorded as the event weight_source_chosen."""
        trainer = dict((await self.trainer.info()).details)
        answers = await asyncio.gather(*(c.info() for c in clients), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not is_unavailable(answer):
                raise answer
        replicas = {c.address: dict(a.details) for c, a in zip(clients, answers) if not isinstance(a, BaseException)}
        choice = choose_source(self.configured, self.fallback, self.engine, trainer, replicas)
        self.active = choice.source == "ipc"
        await events.record("weight_source_chosen", f"weights sync over {choice.source}", source=choice.source,
                            configured=self.configured, reason=choice.reason, replicas=sorted(replicas))
        return choice

    async def sync(self, clients: Sequence[RolloutClient], version: int, weights_address: str
                   ) -> list[pb.UpdateWeightsResponse | BaseException]:
        """Each replica's answer (or error) to one handover of `version`. A replica whose trainer calls failed
        (ABORTED) is TrainerUnavailable; the handover is closed in any case."""
        opened = await self.trainer.open_weight_handover(self.run_id, len(clients))
        try:
            if opened.policy_version != version:
                raise RuntimeError(f"trainer opened a handover of version {opened.policy_version}, expected {version}")
            return list(await asyncio.gather(*(self._map(c, opened, weights_address) for c in clients),
                                             return_exceptions=True))
        finally:
            try:
                await asyncio.shield(self.trainer.close_weight_handover(self.run_id, opened.handover_id))
            except TrainerUnavailable:
                pass  # a lost trainer's buckets went with it

    async def _map(self, client: RolloutClient, opened: pb.WeightHandover, weights_address: str
                   ) -> pb.UpdateWeightsResponse:
        try:
            return await client.map_weights(self.run_id, opened.policy_version, opened.handover_id, weights_address)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                raise TrainerUnavailable(f"replica {client.address} could not map weights: {exc.details()}") from exc
            raise
