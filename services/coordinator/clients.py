"""Thin async gRPC clients for the rollout replicas and the trainer."""
from __future__ import annotations

import functools
from collections.abc import Iterable

import grpc

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken
from services.common.grpc.options import insecure_channel


# gRPC's reconnect backoff grows to 120 s by default: a replica or trainer that
# was down for a minute would then be found again only minutes after it is back.
# A connection attempt to a loopback or LAN address that refuses is cheap, so once
# a second: a restarted service is found within about a second of serving.
RECONNECT_BACKOFF_MAX_MS = 1_000


class RolloutClient:
    def __init__(self, address: str, timeout_s: float, token: BearerToken) -> None:
        self.address = address
        self._channel = insecure_channel(address, token, max_reconnect_backoff_ms=RECONNECT_BACKOFF_MAX_MS)
        self._stub = pb_grpc.RolloutStub(self._channel)
        self._timeout = timeout_s

    async def info(self) -> pb.ServiceInfo:
        return await self._stub.Info(pb.InfoRequest(), timeout=self._timeout)

    async def health(self) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=5)

    async def load_model(self, run_id: str, model_path: str, policy_version: int, engine_config_json: str) -> pb.ServiceInfo:
        resp = await self._stub.LoadModel(
            pb.LoadModelRequest(run_id=run_id, model_path=model_path, policy_version=policy_version,
                                engine_config_json=engine_config_json),
            timeout=self._timeout,
        )
        return resp.info

    async def generate(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        return await self._stub.Generate(request, timeout=self._timeout)

    async def score(self, request: pb.ScoreRequest, timeout_s: float) -> pb.ScoreResponse:
        """A scorer replica's Score (role scorer), under the run's reward.timeout_s rather than rpc_timeout_s."""
        return await self._stub.Score(request, timeout=timeout_s)

    async def pause_generation(self, run_id: str) -> bool:
        """Ask the replica's in-flight Generate to return at its next token boundary; whether one was in flight."""
        return (await self._stub.PauseGeneration(pb.PauseGenerationRequest(run_id=run_id),
                                                 timeout=self._timeout)).paused

    async def sync_weights(self, run_id: str, policy_version: int, trainer_address: str) -> pb.UpdateWeightsResponse:
        """The replica pulls `policy_version` from the trainer at `trainer_address` and applies it.

        Raises TrainerUnavailable when the replica could not read the trainer's stream (ABORTED: the
        trainer is unreachable or changed its weights mid-stream); other errors are the replica's."""
        try:
            return await self._stub.SyncWeights(
                pb.SyncWeightsRequest(run_id=run_id, policy_version=policy_version, trainer_address=trainer_address),
                timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                raise TrainerUnavailable(f"replica {self.address} could not pull weights: {exc.details()}") from exc
            raise

    async def load_weights(self, run_id: str, policy_version: int, directory: str,
                           expected_sha256: str, *, prefetch: bool = False) -> pb.UpdateWeightsResponse:
        """The replica reads the weight directory the trainer wrote, checks its digest, and applies it (with
        `prefetch`: reads, checks and keeps it, for the load of the same directory to apply)."""
        return await self._stub.LoadWeights(
            pb.LoadWeightsRequest(run_id=run_id, policy_version=policy_version, directory=directory,
                                  expected_sha256=expected_sha256, prefetch=prefetch), timeout=self._timeout)

    async def receive_weights(self, plan: pb.BroadcastPlan, rank: int) -> pb.UpdateWeightsResponse:
        """The replica joins the plan's weight-update group as `rank` and applies what the trainer broadcasts."""
        return await self._stub.ReceiveWeights(pb.ReceiveWeightsRequest(plan=plan, rank=rank), timeout=self._timeout)

    async def map_weights(self, run_id: str, policy_version: int, handover_id: str,
                          trainer_address: str) -> pb.UpdateWeightsResponse:
        """The replica fetches the handover's handles from the trainer itself, maps, verifies and applies them."""
        return await self._stub.MapWeights(pb.MapWeightsRequest(
            run_id=run_id, policy_version=policy_version, handover_id=handover_id, trainer_address=trainer_address),
            timeout=self._timeout)

    async def close(self) -> None:
        await self._channel.close()


class TrainerUnavailable(Exception):
    """The trainer did not answer (UNAVAILABLE or deadline): the run can wait for it to come back.

    A type of its own, not the grpc error, so that code handling an unreachable
    rollout replica can never mistake a lost trainer for one."""


class CheckpointOutOfSpace(Exception):
    """The trainer could not write a checkpoint for lack of disk space (RESOURCE_EXHAUSTED): it wrote
    nothing, still holds the run, and the same call succeeds once space returns."""


# A call whose connection dies under it (the trainer killed mid-RPC) can end UNKNOWN ("Stream removed") or
# INTERNAL instead of UNAVAILABLE (grpc/grpc#34076). These codes also carry a live server's own failure, so
# they count as a lost trainer only when the trainer does not answer a health probe right after.
CONNECTION_LOST_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def _trainer_rpc(method):
    name = method.__name__

    @functools.wraps(method)
    async def call(self: "TrainerClient", *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except grpc.aio.AioRpcError as exc:
            if is_unavailable(exc) or (exc.code() in CONNECTION_LOST_CODES and not await self.answers()):
                raise TrainerUnavailable(
                    f"trainer {self.address}: {name} failed with {exc.code().name}: {exc.details()}"
                ) from exc
            raise

    return call


class TrainerClient:
    """Every RPC raises TrainerUnavailable when the trainer cannot be reached."""

    def __init__(self, address: str, timeout_s: float, token: BearerToken, weights_address: str = "") -> None:
        self.address = address
        self.weights_address = weights_address or address
        """Where rollout replicas reach this trainer to pull weights (SyncWeights)."""
        self._channel = insecure_channel(address, token, max_reconnect_backoff_ms=RECONNECT_BACKOFF_MAX_MS)
        self._stub = pb_grpc.TrainerStub(self._channel)
        self._timeout = timeout_s

    @_trainer_rpc
    async def info(self) -> pb.ServiceInfo:
        return await self._stub.Info(pb.InfoRequest(), timeout=self._timeout)

    @_trainer_rpc
    async def health(self) -> pb.HealthResponse:
        return await self._stub.Health(pb.HealthRequest(), timeout=5)

    async def answers(self) -> bool:
        """Whether the trainer process answers at all (any reply, an error status included, but not a lost
        connection): the probe after a call failed with a code a dead connection can also produce."""
        try:
            await self._stub.Health(pb.HealthRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return not (is_unavailable(exc) or exc.code() in CONNECTION_LOST_CODES)
        return True

    @_trainer_rpc
    async def configure(self, run_id: str, model_path: str, seed: int, trainer_config_json: str,
                        resume_checkpoint: str = "") -> pb.ServiceInfo:
        resp = await self._stub.ConfigureRun(
            pb.ConfigureRunRequest(run_id=run_id, model_path=model_path, seed=seed,
                                   trainer_config_json=trainer_config_json, resume_checkpoint=resume_checkpoint),
            timeout=self._timeout,
        )
        return resp.info

    @_trainer_rpc
    async def train_step(self, header: pb.TrainStepHeader, trajectories: Iterable[pb.Trajectory]) -> pb.StepMetrics:
        def chunks():
            yield pb.TrainStepChunk(header=header)
            for t in trajectories:
                yield pb.TrainStepChunk(trajectory=t)

        return await self._stub.TrainStep(chunks(), timeout=self._timeout)

    @_trainer_rpc
    async def save_checkpoint(self, run_id: str, directory: str) -> pb.SaveCheckpointResponse:
        """Raises CheckpointOutOfSpace when the trainer found no space to write it (nothing was written)."""
        try:
            return await self._stub.SaveCheckpoint(
                pb.SaveCheckpointRequest(run_id=run_id, directory=directory), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise CheckpointOutOfSpace(f"trainer {self.address}: SaveCheckpoint: {exc.details()}") from exc
            raise

    @_trainer_rpc
    async def write_weights(self, run_id: str, directory: str, policy_version: int) -> pb.WriteWeightsResponse:
        """The trainer writes `policy_version` (its current weights, or the copy its last TrainStep kept);
        NOT_FOUND if it has neither."""
        return await self._stub.WriteWeights(
            pb.WriteWeightsRequest(run_id=run_id, directory=directory, policy_version=policy_version),
            timeout=self._timeout)

    @_trainer_rpc
    async def open_weight_broadcast(self, run_id: str, replicas: int, *, digest_trailer: bool) -> pb.BroadcastPlan:
        return await self._stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(
            run_id=run_id, replicas=replicas, digest_trailer=digest_trailer), timeout=self._timeout)

    @_trainer_rpc
    async def run_weight_broadcast(self, run_id: str, group_name: str) -> pb.UpdateWeightsResponse:
        return await self._stub.RunWeightBroadcast(pb.RunWeightBroadcastRequest(run_id=run_id, group_name=group_name),
                                                   timeout=self._timeout)

    @_trainer_rpc
    async def abort_weight_broadcast(self, run_id: str, group_name: str,
                                     reason: str) -> pb.AbortWeightBroadcastResponse:
        """The group stops waiting for ranks that will not come; its RunWeightBroadcast fails naming `reason`."""
        return await self._stub.AbortWeightBroadcast(pb.AbortWeightBroadcastRequest(
            run_id=run_id, group_name=group_name, reason=reason), timeout=self._timeout)

    @_trainer_rpc
    async def open_weight_handover(self, run_id: str, replicas: int, bucket_bytes: int = 0) -> pb.WeightHandover:
        return await self._stub.OpenWeightHandover(pb.OpenWeightHandoverRequest(
            run_id=run_id, replicas=replicas, bucket_bytes=bucket_bytes), timeout=self._timeout)

    @_trainer_rpc
    async def close_weight_handover(self, run_id: str, handover_id: str) -> pb.CloseWeightHandoverResponse:
        return await self._stub.CloseWeightHandover(pb.CloseWeightHandoverRequest(
            run_id=run_id, handover_id=handover_id), timeout=self._timeout)

    async def close(self) -> None:
        await self._channel.close()


def is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )


