"""gRPC server of the trainer (grpc.aio): thin handlers over `Trainer`.

Handlers decode, hand heavy work to a worker thread (asyncio.to_thread) under
one lock — a run has one model and one optimizer, so calls are serialized —
and map errors to status codes. The lock is a threading.Lock taken *inside*
the worker thread: when a client goes away mid-step the handler is cancelled
but the thread finishes its update still holding the lock, so a retried
TrainStep waits for it and then sees a replay instead of training twice.
Which weights version GetWeights and WriteWeights serve, and how a request for
a kept version is answered while a step holds the lock, is
services/trainer/weights/serving.py.
Status codes:
- no or a wrong bearer token (any method)   -> UNAUTHENTICATED (services.common.auth's interceptor)
- InvalidRequest (malformed request, or a
  path outside model_roots/checkpoint_roots) -> INVALID_ARGUMENT
- an undecodable message (grpc_decode)      -> INVALID_ARGUMENT
- ConfigureRun / LoadCheckpoint of a model_path / directory that does not
  load (corrupt config, weights, optimizer state) -> INVALID_ARGUMENT
- FailedPrecondition (state does not allow) -> FAILED_PRECONDITION
- GetWeights / WriteWeights of a version the
  trainer neither holds nor kept            -> NOT_FOUND
- SaveCheckpoint / WriteWeights on a full disk
  or quota (OutOfSpace, naming the path)    -> RESOURCE_EXHAUSTED (nothing half-written is left as a
  checkpoint or weight directory; the same call succeeds once space returns)
- StepFailed (update not applied)           -> ABORTED
- anything else                             -> INTERNAL (logged with traceback)
Every one of them leaves the server serving. The mapping is applied, and the
process (health, metrics, graceful stop) run, by services.common.grpc.service,
which the rollout server shares.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from prometheus_client import CollectorRegistry
from safetensors import SafetensorError

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken
from services.common.grpc.service import (
    GrpcServiceHost,
    RpcErrors,
    StatusMap,
    package_version,
    rpc_handler,
    serve_until_signalled,
)
from services.common.metric_defs import TRAINER_METRICS, build_collectors
from services.common.path_roots import OutsideRoots, resolve_inside
from services.common.process.structured_logging import log_event
from services.common.weights import ipc_transport
from services.common.weights.ipc_transport import node_details
from services.common.weights.files import WeightFilesError, write_weight_dir
from services.trainer.checkpoint import ForeignDirectory
from services.trainer.config import TrainerServiceConfig
from services.trainer.data.wire import (
    FailedPrecondition,
    InvalidRequest,
    StepRequest,
    read_train_step,
    step_metrics_message,
)
from services.trainer.disk_space import OutOfSpace, writing
from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer
from services.trainer.parity_gate import ParityVerdict
from services.trainer.plugins import import_attention_plugins
from services.trainer.run_setup import parse_run_config
from services.trainer.trainer import StepFailed, StepOutcome, Trainer
from services.trainer.weights.broadcast_sender import BroadcastFailed, WeightBroadcaster
from services.trainer.weights.ipc_sender import WeightHandoverHost
from services.trainer.weights.serving import VersionNotKept, WeightChunksAsKept, WeightServing

log = logging.getLogger("lockstep.trainer")
SERVICE = "trainer"
T = TypeVar("T")

# What loading files a request named raises when they are not a loadable model or checkpoint (transformers,
# safetensors and torch.load use these); the request's fault, so INVALID_ARGUMENT naming the field.
LOAD_ERRORS = (OSError, ValueError, KeyError, EOFError, SafetensorError, pickle.UnpicklingError)


ERRORS = RpcErrors(SERVICE, StatusMap(
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (VersionNotKept, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (StepFailed, grpc.StatusCode.ABORTED),
    (ForeignDirectory, grpc.StatusCode.INVALID_ARGUMENT),
    (WeightFilesError, grpc.StatusCode.INVALID_ARGUMENT),
    (BroadcastFailed, grpc.StatusCode.ABORTED),
    (OutOfSpace, grpc.StatusCode.RESOURCE_EXHAUSTED),
), log)
status_for = ERRORS.status_for


@contextlib.contextmanager
def loading(field: str) -> Iterator[None]:
    """Files named by request `field` are loaded in the block: a LOAD_ERRORS failure that maps to no
    status of its own is that field's fault (INVALID_ARGUMENT naming it), not the trainer's."""
    try:
        yield
    except LOAD_ERRORS as exc:
        if status_for(exc) != grpc.StatusCode.INTERNAL:
            raise
        raise InvalidRequest(f"{field}: cannot load: {exc}") from None


def parity_report(verdict: ParityVerdict) -> pb.ParityReport:
    return pb.ParityReport(
        passed=verdict.passed, message=verdict.message(), stats=verdict.stats,
        worst_tokens=[pb.ParityToken(sample_id=w.sample_id, position=w.position, logp=w.logp,
                                     rollout_logp=w.rollout_logp) for w in verdict.worst],
        attention_backend=verdict.attention_backend, logprob_backend=verdict.logprob_backend,
    )


def weights_device(trainer: Trainer | GroupTrainer) -> str | None:
    """Where the weights an IPC handover packs live: the trainer's device (a group's: its rank 0's)."""
    return getattr(trainer, "device", None) or getattr(getattr(trainer, "trainer", None), "device", None)


def confined(value: str, roots: Sequence[str], field: str) -> str:
    """`value` resolved inside `roots`; InvalidRequest naming `field` otherwise (checked before any file access)."""
    try:
        return str(resolve_inside(value, roots, field))
    except OutsideRoots as exc:
        raise InvalidRequest(str(exc)) from None


class TrainerServicer(pb_grpc.TrainerServicer):
    def __init__(self, trainer: Trainer, collectors: dict[str, object], *, weight_chunk_bytes: int,
                 model_roots: Sequence[str], checkpoint_roots: Sequence[str], broadcaster: WeightBroadcaster,
                 handovers: WeightHandoverHost | None = None) -> None:
        self.trainer = trainer
        self.broadcaster = broadcaster
        self.handovers = handovers if handovers is not None else WeightHandoverHost(
            trainer, bucket_bytes=ipc_transport.DEFAULT_BUCKET_BYTES, logger=log)
        self.metrics = collectors
        self.model_roots, self.checkpoint_roots = tuple(model_roots), tuple(checkpoint_roots)
        self.lock = threading.Lock()
        self.weights = WeightServing(trainer, self.lock, chunk_bytes=weight_chunk_bytes)

    def close(self) -> None:
        self.weights.close()
        self.handovers.close()

    async def _locked(self, fn: Callable[..., T], *args: object) -> T:
        def run() -> T:
            with self.lock:
                return fn(*args)

        return await asyncio.to_thread(run)

    async def _locked_changing_weights(self, fn: Callable[..., T], *args: object) -> T:
        """_locked for a call that may change the weights: the version served of the old ones is withdrawn."""
        return await self._locked(self.weights.changing_weights, fn, *args)

    def _train_step(self, req: StepRequest) -> StepOutcome:
        """Under the lock: the served weights follow the step's keep_previous_weights, then it trains."""
        self.weights.before_step(req)
        return self.trainer.train_step(req)

    def _service_info(self) -> pb.ServiceInfo:
        info = self.trainer.info()
        service_info = pb.ServiceInfo(service=SERVICE, version=package_version(), **info)
        service_info.details.update(node_details(weights_device(self.trainer)))
        return service_info

    # ------------------------------------------------------------ RPCs --

    @rpc_handler(ERRORS, "ConfigureRun")
    async def ConfigureRun(self, request: pb.ConfigureRunRequest, context) -> pb.ConfigureRunResponse:
        with loading("resume_checkpoint" if request.resume_checkpoint else "model_path"):
            model_path = confined(request.model_path, self.model_roots, "model_path")
            resume = request.resume_checkpoint and confined(request.resume_checkpoint, self.checkpoint_roots,
                                                            "resume_checkpoint")
            # A teacher (on-policy distillation) is a model the trainer loads: inside the same roots.
            teacher = parse_run_config(request.trainer_config_json).teacher
            if teacher is not None:
                confined(teacher.model_path, self.model_roots, "trainer_config_json.teacher.model_path")
            run = await self._locked_changing_weights(lambda: self.trainer.configure(
                run_id=request.run_id, model_path=model_path, seed=request.seed,
                config_json=request.trainer_config_json, resume_checkpoint=resume,
            ))
        self.metrics["lockstep_trainer_policy_version"].labels(SERVICE).set(run.policy_version)
        return pb.ConfigureRunResponse(info=self._service_info())

    @rpc_handler(ERRORS, "TrainStep")
    async def TrainStep(self, request_iterator: AsyncIterator[pb.TrainStepChunk], context) -> pb.StepMetrics:
        steps = self.metrics["lockstep_trainer_steps_total"]
        t0 = time.monotonic()
        try:
            req = await read_train_step(request_iterator)
            outcome = await self._locked(self._train_step, req)
        except grpc.aio.AbortError:  # an undecodable message: refused with its own status
            steps.labels(SERVICE, "rejected").inc()
            raise
        except Exception as exc:
            steps.labels(SERVICE, "rejected" if status_for(exc) != grpc.StatusCode.INTERNAL else "failed").inc()
            raise
        seconds = time.monotonic() - t0
        if outcome.replayed:
            steps.labels(SERVICE, "replayed").inc()
        else:
            steps.labels(SERVICE, "trained").inc()
            self.metrics["lockstep_trainer_tokens_total"].labels(SERVICE).inc(outcome.metrics["tokens_total"])
            self.metrics["lockstep_trainer_step_seconds"].labels(SERVICE).observe(seconds)
            self.metrics["lockstep_trainer_policy_version"].labels(SERVICE).set(outcome.policy_version)
        log_event(log, "train step", run_id=req.run_id, step=req.step, replayed=outcome.replayed,
                  seconds=round(seconds, 4), iw_mean=outcome.metrics["iw_mean"], loss=outcome.metrics["loss"])
        return step_metrics_message(req.run_id, outcome.step, outcome.policy_version, outcome.metrics,
                                    replayed=outcome.replayed, sample_weights=outcome.sample_weights)

    @rpc_handler(ERRORS, "CheckParity")
    async def CheckParity(self, request_iterator: AsyncIterator[pb.TrainStepChunk], context) -> pb.ParityReport:
        req = await read_train_step(request_iterator)
        verdict = await self._locked(self.trainer.check_parity, req)
        return parity_report(verdict)

    async def GetWeights(self, request: pb.GetWeightsRequest, context) -> AsyncIterator[bytes]:
        """Yields serialized WeightChunks: registered without a response serializer (add_trainer_service)."""
        if request.chunk_bytes < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk_bytes: must be >= 0, got {request.chunk_bytes}")
        chunk_bytes = request.chunk_bytes or self.weights.chunk_bytes
        wanted = request.policy_version if request.HasField("policy_version") else None
        try:
            served = await asyncio.to_thread(self.weights.hold, request.run_id, wanted, chunk_bytes)
        except FailedPrecondition as exc:
            await context.abort(status_for(exc), str(exc))
        try:
            async with contextlib.aclosing(self.weights.chunks(served, wanted)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except FailedPrecondition as exc:  # the weights changed, or were withdrawn, mid-stream
            await context.abort(grpc.StatusCode.ABORTED, str(exc))

    @rpc_handler(ERRORS, "SaveCheckpoint")
    async def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context) -> pb.SaveCheckpointResponse:
        directory = confined(request.directory, self.checkpoint_roots, "directory")
        with writing("directory", directory):
            path, version = await self._locked(self.trainer.save_checkpoint, request.run_id, directory)
        return pb.SaveCheckpointResponse(directory=str(path), policy_version=version)

    @rpc_handler(ERRORS, "WriteWeights")
    async def WriteWeights(self, request: pb.WriteWeightsRequest, context) -> pb.WriteWeightsResponse:
        """Cut (or take the kept copy of) the version under the lock, then write it from host memory off the
        lock: a step that trains meanwhile does not wait for the disk."""
        directory = confined(request.directory, self.checkpoint_roots, "directory")
        wanted = request.policy_version if request.HasField("policy_version") else None
        served = await asyncio.to_thread(self.weights.hold, request.run_id, wanted, self.weights.chunk_bytes)
        try:
            snapshot = served.snapshot
            if snapshot.lora is not None:
                raise FailedPrecondition("WriteWeights: a LoRA run's adapters sync over the gRPC stream")
            with writing("directory", directory):
                written = await asyncio.to_thread(write_weight_dir, directory, served.version.tensors(),
                                                  snapshot.policy_version, base_dir=snapshot.run.model_path)
        finally:
            served.version.release()
        log_event(log, "weights written", run_id=request.run_id, directory=str(written.directory),
                  policy_version=written.policy_version, bytes=written.nbytes)
        return pb.WriteWeightsResponse(directory=str(written.directory), policy_version=written.policy_version,
                                       tensors=written.tensors, bytes=written.nbytes,
                                       total_sha256=written.total_sha256)

    @rpc_handler(ERRORS, "LoadCheckpoint")
    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest, context) -> pb.LoadCheckpointResponse:
        with loading("directory"):
            directory = confined(request.directory, self.checkpoint_roots, "directory")
            version = await self._locked_changing_weights(self.trainer.load_checkpoint, request.run_id, directory)
        self.metrics["lockstep_trainer_policy_version"].labels(SERVICE).set(version)
        return pb.LoadCheckpointResponse(policy_version=version)

    @rpc_handler(ERRORS, "OpenWeightBroadcast")
    async def OpenWeightBroadcast(self, request: pb.OpenWeightBroadcastRequest, context) -> pb.BroadcastPlan:
        return await self._locked(self.broadcaster.open, request)

    @rpc_handler(ERRORS, "RunWeightBroadcast")
    async def RunWeightBroadcast(self, request: pb.RunWeightBroadcastRequest, context) -> pb.UpdateWeightsResponse:
        # Under the lock for the whole broadcast: no step changes the weights between two buckets.
        return await self._locked(self.broadcaster.run, request)

    @rpc_handler(ERRORS, "AbortWeightBroadcast")
    async def AbortWeightBroadcast(self, request: pb.AbortWeightBroadcastRequest, context
                                   ) -> pb.AbortWeightBroadcastResponse:
        # Never under the lock: the broadcast it stops holds it. The broadcaster guards its own plans.
        return self.broadcaster.abort(request)

    # IPC source (services/trainer/weights/ipc_sender.py): only the packing holds the lock; a replica's calls run
    # beside a step, the handover host guards its own state.
    @rpc_handler(ERRORS, "OpenWeightHandover")
    async def OpenWeightHandover(self, request: pb.OpenWeightHandoverRequest, context) -> pb.WeightHandover:
        return await self._locked(self.handovers.open, request)

    @rpc_handler(ERRORS, "GetWeightHandles")
    async def GetWeightHandles(self, request: pb.GetWeightHandlesRequest, context) -> pb.WeightHandles:
        return await asyncio.to_thread(self.handovers.handles, request)

    @rpc_handler(ERRORS, "VerifyWeightHandover")
    async def VerifyWeightHandover(self, request: pb.VerifyWeightHandoverRequest, context
                                   ) -> pb.VerifyWeightHandoverResponse:
        return await asyncio.to_thread(self.handovers.verify, request)

    @rpc_handler(ERRORS, "ReleaseWeightHandles")
    async def ReleaseWeightHandles(self, request: pb.ReleaseWeightHandlesRequest, context
                                   ) -> pb.ReleaseWeightHandlesResponse:
        return await asyncio.to_thread(self.handovers.release, request)

    @rpc_handler(ERRORS, "CloseWeightHandover")
    async def CloseWeightHandover(self, request: pb.CloseWeightHandoverRequest, context
                                  ) -> pb.CloseWeightHandoverResponse:
        return await asyncio.to_thread(self.handovers.close_handover, request)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        if self.lock.locked():
            status = "busy"
        elif self.trainer.run is None:
            status = "not_loaded"
        else:
            status = "serving"
        return pb.HealthResponse(ok=True, status=status)

    async def Info(self, request: pb.InfoRequest, context) -> pb.ServiceInfo:
        return self._service_info()


def add_trainer_service(servicer: "TrainerServicer", server: grpc.aio.Server) -> None:
    pb_grpc.add_TrainerServicer_to_server(servicer, WeightChunksAsKept(server))


class TrainerServer:
    """Build -> serve -> close. Owns the trainer and its servicer; the process around them is a
    GrpcServiceHost."""

    def __init__(self, config: TrainerServiceConfig, token: BearerToken) -> None:
        self.config = config
        import_attention_plugins(config.attention_plugins)
        registry = CollectorRegistry()
        collectors = build_collectors(TRAINER_METRICS, registry)
        self.trainer = build_trainer(config, token)
        broadcaster = WeightBroadcaster(self.trainer, address=config.weight_broadcast_address, token=token,
                                        bucket_bytes=config.weight_broadcast_bucket_bytes,
                                        timeout_s=config.weight_broadcast_timeout_s, logger=log,
                                        limits=config.rendezvous_limits())
        broadcaster.start()  # before any RPC: a rendezvous address this host cannot serve stops the trainer
        self.servicer = TrainerServicer(self.trainer, collectors, weight_chunk_bytes=config.weight_chunk_bytes,
                                        model_roots=config.model_roots, checkpoint_roots=config.checkpoint_roots,
                                        broadcaster=broadcaster,
                                        handovers=WeightHandoverHost(self.trainer, logger=log,
                                                                     bucket_bytes=config.weight_ipc_bucket_bytes,
                                                                     digest_on=config.weight_ipc_digest,
                                                                     device=weights_device(self.trainer)))
        self.host = GrpcServiceHost(
            SERVICE, lambda server: add_trainer_service(self.servicer, server), token,
            host=config.host, grpc_port=config.grpc_port, metrics_port=config.metrics_port, registry=registry,
            shutdown_grace_s=config.shutdown_grace_s, logger=log)

    async def close(self) -> None:
        self.servicer.close()
        self.servicer.broadcaster.close()
        if isinstance(self.trainer, GroupTrainer):
            await asyncio.to_thread(self.trainer.close)


def build_trainer(config: TrainerServiceConfig, token: BearerToken) -> Trainer | GroupTrainer:
    """`token`: the deployment's, which the ranks of a group present at rank 0's rendezvous."""
    if config.data_parallel == 1:
        return Trainer(device=config.device, num_threads=config.num_threads)
    return GroupTrainer(GroupSpec(world_size=config.data_parallel, device=config.device,
                                  num_threads=config.num_threads, timeout_s=config.collective_timeout_s,
                                  log_level=config.log_level, attention_plugins=tuple(config.attention_plugins),
                                  rendezvous=config.rank_rendezvous()), token)


async def serve(config: TrainerServiceConfig, token: BearerToken) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully (in-flight RPCs get `shutdown_grace_s`)."""
    server = TrainerServer(config, token)
    await serve_until_signalled(server.host, close=server.close, device=config.device)
