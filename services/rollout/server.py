"""gRPC (grpc.aio) rollout service: thin handlers over one Engine.

Status codes the coordinator can rely on:
- UNAUTHENTICATED: the call lacks the deployment's bearer token (every method;
  checked by services.common.auth.BearerTokenInterceptor before any handler).
- INVALID_ARGUMENT: a malformed request (message names the field), a message
  that does not decode (services.common.grpc.decode), a model_path outside the
  service's model_roots, an unknown engine (message lists the known ones), bad
  engine options, a model_path LoadModel cannot load (naming the weight file
  that does not load: a pickle torch.load(weights_only=True) refuses, a corrupt
  safetensors header, an index naming a shard outside the directory), a weight stream that
  fails any checksum / structure check or does not match the model; a
  LoadWeights directory outside model_roots, or whose version or recomputed
  digest is not the one requested. The state
  is unchanged and the server keeps serving.
- FAILED_PRECONDITION: no model loaded; Generate for a policy_version or
  run_id other than the loaded one; UpdateWeights or SyncWeights for another
  run, SyncWeights when the trainer serves another version; an engine
  whose optional dependency is not installed; a device that is not on this
  host (`cuda:99`, CUDA on a CPU host).
- PERMISSION_DENIED: SyncWeights names a trainer that is not one of the
  service's weight_sources.
- PERMISSION_DENIED: ReceiveWeights names a rendezvous that is not one of
  the service's broadcast_sources.
- PERMISSION_DENIED: MapWeights names a trainer outside weight_sources, or
  the handles it got are not this replica's to map (another run, node,
  device or handover id, a stale version, fields not of torch's form).
- FAILED_PRECONDITION: MapWeights' trainer refused the handover (its reason).
- ABORTED: SyncWeights could not read the trainer's stream (trainer
  unreachable, or its weights changed mid-stream), ReceiveWeights' group
  did not form or lost a bucket, or MapWeights could not reach the trainer;
  nothing was applied.
- UNAVAILABLE: the engine cannot serve right now (EngineUnavailable); retry.
- INTERNAL: an engine bug (e.g. non-finite log-probs); logged with a traceback.
The mapping is applied, and the process (health, metrics, graceful stop) run,
by services.common.grpc.service, which the trainer server shares.

Engine work runs on one dedicated worker thread so the event loop keeps
answering Health while a batch runs, and one asyncio lock orders Generate,
LoadModel and the apply step of UpdateWeights: weights change only between
batches, never during one.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import grpc
import torch
from prometheus_client import CollectorRegistry
from safetensors import SafetensorError

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken
from services.common.grpc.options import insecure_channel
from services.common.grpc.service import (
    GrpcServiceHost,
    RpcErrors,
    RpcFailure,
    StatusMap,
    package_version,
    rpc_handler,
    serve_until_signalled,
)
from services.common.metric_defs import ROLLOUT_METRICS, build_collectors
from services.common.path_roots import resolve_inside
from services.common.process.structured_logging import log_event
from services.common.rendezvous.store import RendezvousClient
from services.common.weights.broadcast_protocol import bucket_specs
from services.common.weights.files import WeightFiles, read_weight_dir
from services.common.weights.finite_check import FiniteTensors
from services.common.weights.ipc_transport import HandleRefused, node_details
from services.common.weights.stream import WeightStreamAssembler
from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import DeviceUnavailable, Engine, EngineUnavailable
from services.rollout.episodes.requests import episode_request_from_proto, episodes_to_proto
from services.rollout.registry import build_engine
from services.rollout.scorer.role import ScorerRole, check_scorer_engine
from services.rollout.weights.broadcast_receiver import (
    BroadcastReceiveFailed,
    checked_plan,
    receive_broadcast,
    staging_device,
)
from services.rollout.weights.ipc_receiver import HandoverDenied, HandoverFailed, IpcReceiver
from services.rollout.weights.prefetch import PREFETCH_READ_THREADS, Allocate, DirectoryKey, WeightPrefetch
from services.rollout.weights.staging_arena import StagingArena
from services.rollout.wire import (
    check_sample_order,
    generation_request_from_proto,
    samples_to_proto,
    split_engine_config,
)

log = logging.getLogger("lockstep.rollout")
SERVICE = "rollout"
T = TypeVar("T")
# The trainer's GetWeights, called without a response deserializer (SyncWeights reads the raw chunks).
GET_WEIGHTS_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Trainer'].full_name}/GetWeights"
# What loading a model directory the request named raises when the directory is not a loadable model
# (missing or corrupt config/weights); transformers and safetensors use these, and EnvironmentError. A weight
# file that does not load is named by services.common.models.weight_files (a WeightFileError, a ValueError); a
# pickle torch.load(weights_only=True) refuses is that file's fault too, never the service's.
MODEL_LOAD_ERRORS = (OSError, ValueError, KeyError, EOFError, SafetensorError, pickle.UnpicklingError)


ERRORS = RpcErrors(SERVICE, StatusMap(
    (EngineUnavailable, grpc.StatusCode.UNAVAILABLE),
    (HandleRefused, grpc.StatusCode.PERMISSION_DENIED),
    (HandoverFailed, grpc.StatusCode.ABORTED),
    (HandoverDenied, grpc.StatusCode.FAILED_PRECONDITION),
    (DeviceUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    ((ValueError, FileNotFoundError), grpc.StatusCode.INVALID_ARGUMENT),
    (ImportError, grpc.StatusCode.FAILED_PRECONDITION),
    (BroadcastReceiveFailed, grpc.StatusCode.ABORTED),
), log)
status_for = ERRORS.status_for  # the one exception -> status mapping of this service
__all__ = ["RolloutService", "RolloutServicer", "RpcFailure", "serve", "status_for"]


class RolloutServicer(pb_grpc.RolloutServicer):
    """Holds the loaded engine; every handler is a few lines over the pure helpers in wire.py."""

    def __init__(self, config: RolloutServiceConfig, metrics: dict[str, Any], token: BearerToken) -> None:
        self.config = config
        self.metrics = metrics
        self._token = token  # the deployment's one token: also what SyncWeights presents to the trainer
        self.engine: Engine | None = None
        self.engine_name = ""
        self.run_id = ""
        self._lock = asyncio.Lock()
        # One thread: engines are not thread-safe and torch's own intra-op
        # threads do the parallel work.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-engine")
        self._staging: StagingArena | None = None
        self._prefetch = WeightPrefetch(self._staging_arena)  # LoadWeights' prefetched directory
        self._ipc = IpcReceiver(digest_on=config.weight_ipc_digest)  # MapWeights' hashing, kept between handovers
        self._scorer: ScorerRole | None = None  # role scorer: the loaded model's Score side

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _loaded(self) -> Engine:
        if self.engine is None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "no model loaded (call LoadModel first)")
        return self.engine

    def _require_role(self, role: str, what: str) -> None:
        """A scorer replica scores and never follows the trainer; a policy replica never scores."""
        if self.config.role != role:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"role: {what} needs a replica of role {role!r}; this one is {self.config.role!r}")

    def _check_run(self, run_id: str, what: str) -> None:
        if run_id != self.run_id:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run_id: {what} is for run {run_id!r} but the loaded run is {self.run_id!r}",
            )

    # ------------------------------------------------------------ handlers --

    @rpc_handler(ERRORS, "Generate", counter="lockstep_rollout_requests_total")
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        started = time.perf_counter()
        self._require_role("policy", "Generate")
        async with self._lock:
            engine = self._loaded()
            self._check_run(request.run_id, "Generate")
            if request.policy_version != engine.policy_version:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"policy_version: request wants {request.policy_version}, engine holds {engine.policy_version}",
                )
            if request.HasField("episode"):
                episodes = await self._in_worker(engine.run_episodes, episode_request_from_proto(request))
                version = engine.policy_version
                out = episodes_to_proto(episodes, version)
                generated = sum(sum(e.response_mask) for e in episodes)
            else:
                gen = generation_request_from_proto(request)
                if gen.resumed and not engine.supports_resume:
                    raise ValueError(f"resumed: the {self.engine_name} engine cannot continue paused samples")
                samples = await self._in_worker(engine.generate, gen)
                check_sample_order(gen, samples)
                version = engine.policy_version
                out = samples_to_proto(samples, version)
                generated = sum(len(s.token_ids) for s in samples)
            self._count_prefill(engine)  # under the lock: no other request's work is counted in
        self.metrics["lockstep_rollout_generated_tokens_total"].labels(SERVICE).inc(generated)
        self.metrics["lockstep_rollout_generate_seconds"].labels(SERVICE).observe(time.perf_counter() - started)
        return pb.GenerateResponse(samples=out, policy_version=version, engine=self.engine_name)

    def _count_prefill(self, engine: Engine) -> None:
        counts = engine.take_prefill_counts()
        if counts is None:
            return
        self.metrics["lockstep_rollout_prefill_tokens_total"].labels(SERVICE).inc(counts.prefill_tokens)
        self.metrics["lockstep_rollout_reused_prefix_tokens_total"].labels(SERVICE).inc(counts.reused_tokens)
        for reason, n in counts.misses.items():
            self.metrics["lockstep_rollout_kv_reuse_misses_total"].labels(SERVICE, reason).inc(n)

    @rpc_handler(ERRORS, "PauseGeneration")
    async def PauseGeneration(self, request: pb.PauseGenerationRequest,
                              context: grpc.aio.ServicerContext) -> pb.PauseGenerationResponse:
        # Not under the lock: the Generate it stops holds it until it returns.
        engine = self._loaded()
        self._check_run(request.run_id, "PauseGeneration")
        # In a thread: an engine's pause may wait on its server (SGLang's waits for the aborted requests).
        return pb.PauseGenerationResponse(paused=await asyncio.to_thread(engine.request_pause))

    @rpc_handler(ERRORS, "LoadModel")
    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext) -> pb.LoadModelResponse:
        name, options = split_engine_config(request.engine_config_json, self.config.engine)
        resolved = resolve_inside(request.model_path, self.config.model_roots, "model_path")
        check_scorer_engine(self.config.role, name, resolved)  # before anything is built or launched
        model_path = str(resolved)
        async with self._lock:
            old = self.engine
            try:
                # The loaded engine takes the new run itself when nothing but the weights differ.
                reloaded = old is not None and self.engine_name == name and await self._in_worker(
                    old.reload, options, model_path, request.policy_version)
            except MODEL_LOAD_ERRORS as exc:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"model_path: cannot load {request.model_path!r}: {exc}") from None
            if reloaded:
                engine = old
            else:
                # Build and load completely before swapping: a failed load leaves
                # the previously loaded engine serving, untouched.
                engine = await self._in_worker(build_engine, name, options, self.config)
                try:
                    await self._in_worker(engine.load, model_path, request.policy_version)
                except MODEL_LOAD_ERRORS as exc:
                    await self._in_worker(engine.close)
                    raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"model_path: cannot load {request.model_path!r}: {exc}") from None
                self.engine = engine
                if old is not None:
                    await self._in_worker(old.close)
            self.engine_name, self.run_id = name, request.run_id
            if self.config.role == "scorer":  # its weights' digest and a judge's tokenizer, read once per load
                self._scorer = await self._in_worker(ScorerRole, engine, name)
        await self._prefetch.release()  # a directory of the run before is not wanted any more
        with contextlib.suppress(ValueError):  # an engine whose model is in another process maps nothing here
            await asyncio.to_thread(self._ipc.warm, engine.broadcast_device())
        self.metrics["lockstep_rollout_policy_version"].labels(SERVICE).set(engine.policy_version)
        log_event(log, "model loaded", engine=name, model_path=model_path, reloaded=reloaded,
                  run_id=request.run_id, policy_version=engine.policy_version)
        return pb.LoadModelResponse(info=self._info())

    @rpc_handler(ERRORS, "UpdateWeights", counter="lockstep_rollout_weight_updates_total")
    async def UpdateWeights(
        self, request_iterator: AsyncIterator[pb.WeightChunk], context: grpc.aio.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        self._require_role("policy", "UpdateWeights")  # a scorer's weights are fixed for the run
        # Receive and verify the whole stream before taking the lock, so
        # generation continues during the transfer; WeightStreamError is a
        # ValueError -> INVALID_ARGUMENT and nothing is applied.
        assembler = WeightStreamAssembler(check_finite=True)
        async for chunk in request_iterator:
            assembler.add(chunk)
        return await self._apply(assembler, "UpdateWeights")

    @rpc_handler(ERRORS, "SyncWeights", counter="lockstep_rollout_weight_updates_total")
    async def SyncWeights(self, request: pb.SyncWeightsRequest, context: grpc.aio.ServicerContext
                          ) -> pb.UpdateWeightsResponse:
        self._require_role("policy", "SyncWeights")  # a scorer's weights are fixed for the run
        if request.trainer_address not in self.config.weight_sources:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"trainer_address: {request.trainer_address!r} is not one of this service's "
                             f"weight_sources {self.config.weight_sources}")
        self._check_run(request.run_id, "SyncWeights")  # before pulling gigabytes for nothing
        staging = self._staging_arena()
        with staging.lease() as lease:
            # Chunks are taken as the trainer encoded them (no deserializer): the assembler reads the
            # payload out of each message without protobuf's copies (services.common.weights.chunk_frames).
            assembler = WeightStreamAssembler(check_finite=True, allocate=lease.allocate)
            channel = insecure_channel(request.trainer_address, self._token)
            try:
                stream = channel.unary_stream(GET_WEIGHTS_METHOD,
                                              request_serializer=pb.GetWeightsRequest.SerializeToString,
                                              response_deserializer=None)(
                    # Named: the trainer serves that version even after it moved on, if it kept it.
                    pb.GetWeightsRequest(run_id=request.run_id, policy_version=request.policy_version))
                async for raw in stream:
                    assembler.add_raw(raw)
                    if assembler.policy_version != request.policy_version:
                        stream.cancel()
                        raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"policy_version: the trainer serves version {assembler.policy_version}, "
                                         f"not {request.policy_version}")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # it has not that version: the request's fault
                    raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"trainer {request.trainer_address}: {exc.details()}") from None
                raise RpcFailure(grpc.StatusCode.ABORTED, f"trainer {request.trainer_address}: GetWeights failed "
                                 f"with {exc.code().name}: {exc.details()}") from None
            finally:
                await channel.close()
            return await self._apply(assembler, "SyncWeights")

    def _staging_arena(self) -> StagingArena:
        """The receive memory of SyncWeights, kept between syncs; pinned for an engine on a GPU."""
        try:
            pin = self._loaded().broadcast_device().type == "cuda"
        except ValueError:  # an engine whose model is in another process (SGLang) copies from host memory
            pin = False
        if self._staging is None or self._staging.pin_memory != pin:
            self._staging = StagingArena(pin_memory=pin)
        return self._staging

    @rpc_handler(ERRORS, "LoadWeights", counter="lockstep_rollout_weight_updates_total")
    async def LoadWeights(self, request: pb.LoadWeightsRequest, context: grpc.aio.ServicerContext
                          ) -> pb.UpdateWeightsResponse:
        self._require_role("policy", "LoadWeights")  # a scorer's weights are fixed for the run
        # Confined like LoadModel's model_path; read and verified off the lock (generation goes on), and a
        # directory whose version or digest disagrees (WeightFilesError, a ValueError) applies nothing.
        directory = resolve_inside(request.directory, self.config.model_roots, "directory")
        self._check_run(request.run_id, "LoadWeights")
        if not request.expected_sha256:
            raise ValueError("expected_sha256: required (the digest the trainer reported for the directory)")
        key = DirectoryKey(str(directory), request.policy_version, request.expected_sha256)

        def read(allocate: Allocate) -> tuple[dict[str, torch.Tensor], WeightFiles]:
            return read_weight_dir(directory, policy_version=request.policy_version, allocate=allocate,
                                   expected_sha256=request.expected_sha256,
                                   threads=PREFETCH_READ_THREADS if request.prefetch else None)

        if request.prefetch:  # read into the kept staging memory now, applied by the load that names it
            files = await self._prefetch.prefetch(key, read)
            log_event(log, "weights prefetched", policy_version=files.policy_version, bytes=files.nbytes)
            return pb.UpdateWeightsResponse(policy_version=files.policy_version, tensors=files.tensors,
                                            bytes=files.nbytes, total_sha256=files.total_sha256)
        async with self._prefetch.loaded(key, read) as (tensors, files, early):
            async with self._lock:
                engine = self._loaded()
                self._check_run(request.run_id, "LoadWeights")
                await self._in_worker(engine.update_weights_from_dir, str(directory), tensors, files.policy_version)
        response = self._applied("LoadWeights", files.policy_version, len(tensors), files.nbytes, files.total_sha256,
                                 lora=False)
        response.prefetched = early
        return response

    @rpc_handler(ERRORS, "ReceiveWeights", counter="lockstep_rollout_weight_updates_total")
    async def ReceiveWeights(self, request: pb.ReceiveWeightsRequest, context: grpc.aio.ServicerContext
                             ) -> pb.UpdateWeightsResponse:
        self._require_role("policy", "ReceiveWeights")  # a scorer's weights are fixed for the run
        plan = request.plan
        if plan.rendezvous not in self.config.broadcast_sources:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"plan.rendezvous: {plan.rendezvous!r} is not one of this service's "
                             f"broadcast_sources {self.config.broadcast_sources}")
        self._check_run(plan.run_id, "ReceiveWeights")
        if getattr(self._loaded(), "joins_weight_groups", False):
            return await self._receive_in_engine(request)
        buckets = checked_plan(request)
        device = staging_device(plan.backend, self._loaded().broadcast_device())
        # Received into staging off the lock (generation goes on), applied between batches like a stream.
        with self._rendezvous(plan) as store:
            got = await asyncio.to_thread(receive_broadcast, request, buckets, device, store,
                                          self.config.weight_broadcast_timeout_s)
        async with self._lock:
            engine = self._loaded()
            self._check_run(plan.run_id, "ReceiveWeights")
            if got.lora is not None:
                await self._in_worker(engine.update_lora_adapter, got.lora, got.tensors, plan.policy_version)
            else:
                await self._in_worker(engine.update_weights, got.tensors, plan.policy_version)
        return self._applied("ReceiveWeights", plan.policy_version, len(got.tensors), got.nbytes, got.total_sha256,
                             lora=got.lora is not None)

    @rpc_handler(ERRORS, "MapWeights", counter="lockstep_rollout_weight_updates_total")
    async def MapWeights(self, request: pb.MapWeightsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.UpdateWeightsResponse:
        self._require_role("policy", "MapWeights")  # a scorer's weights are fixed for the run
        # The handles come from the trainer the replica itself calls (one of weight_sources), never from the caller.
        if request.trainer_address not in self.config.weight_sources:
            raise RpcFailure(grpc.StatusCode.PERMISSION_DENIED,
                             f"trainer_address: {request.trainer_address!r} is not one of this service's "
                             f"weight_sources {self.config.weight_sources}")
        self._check_run(request.run_id, "MapWeights")
        engine = self._loaded()
        try:
            engine.broadcast_device()
        except ValueError:
            raise ValueError(f"rollout.weight_sync: the {self.engine_name} engine holds its model in another "
                             "process and cannot map IPC weights") from None

        async def apply(tensors: dict[str, torch.Tensor], version: int, lora) -> None:
            async with self._lock:  # between batches, as every other source
                engine = self._loaded()
                self._check_run(request.run_id, "MapWeights")
                if lora is not None:
                    await self._in_worker(engine.update_lora_adapter, lora, tensors, version)
                else:
                    await self._in_worker(partial(engine.update_weights,
                                                  finite_checked=isinstance(tensors, FiniteTensors)), tensors, version)

        channel = insecure_channel(request.trainer_address, self._token)
        try:
            got = await self._ipc.receive(pb_grpc.TrainerStub(channel), request,
                                          current_version=engine.policy_version, apply=apply)
        finally:
            await channel.close()
        return self._applied("MapWeights", got.policy_version, got.tensors, got.nbytes, got.total_sha256,
                             lora=got.lora is not None)

    @contextlib.contextmanager
    def _rendezvous(self, plan: pb.BroadcastPlan) -> Iterator[RendezvousClient]:
        """The plan's rendezvous (one of broadcast_sources), reached with the deployment's token."""
        store = RendezvousClient(plan.rendezvous, self._token, self.config.weight_broadcast_timeout_s)
        try:
            yield store
        finally:
            store.close()

    async def _receive_in_engine(self, request: pb.ReceiveWeightsRequest) -> pb.UpdateWeightsResponse:
        """An engine whose server is the rank (SGLang) loads the buckets itself, between batches. Its answer
        carries no sha256 of the bytes (they never reach this process) but the engine's checksum of the
        parameters it then serves."""
        plan = request.plan
        buckets = bucket_specs(plan)
        async with self._lock:
            engine = self._loaded()
            self._check_run(plan.run_id, "ReceiveWeights")
            with self._rendezvous(plan) as store:
                checksum = await self._in_worker(engine.receive_broadcast, request, buckets, store)
        response = self._applied("ReceiveWeights", plan.policy_version, int(plan.tensors), int(plan.bytes), "",
                                 lora=False)
        response.engine_checksum = checksum
        return response

    async def _apply(self, assembler: WeightStreamAssembler, what: str) -> pb.UpdateWeightsResponse:
        """Apply a received stream (all of it verified by finish()) between batches."""
        tensors = assembler.finish()
        version = int(assembler.policy_version)
        async with self._lock:
            engine = self._loaded()
            self._check_run(assembler.run_id or "", what)
            if assembler.lora is not None:
                await self._in_worker(engine.update_lora_adapter, assembler.lora, tensors, version)
            else:
                await self._in_worker(partial(engine.update_weights, finite_checked=assembler.finite_checked),
                                      tensors, version)
        return self._applied(what, version, len(tensors), assembler.nbytes, assembler.total_sha256,
                             lora=assembler.lora is not None)

    def _applied(self, what: str, version: int, tensors: int, nbytes: int, digest: str, *, lora: bool
                 ) -> pb.UpdateWeightsResponse:
        self.metrics["lockstep_rollout_policy_version"].labels(SERVICE).set(version)
        log_event(log, "weights updated", via=what, policy_version=version, tensors=tensors, bytes=nbytes, lora=lora)
        return pb.UpdateWeightsResponse(policy_version=version, tensors=tensors, bytes=nbytes, total_sha256=digest)

    @rpc_handler(ERRORS, "Score", counter="lockstep_rollout_requests_total")
    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        started = time.perf_counter()
        self._require_role("scorer", "Score")
        async with self._lock:
            self._loaded()
            self._check_run(request.run_id, "Score")
            response = await self._in_worker(self._scorer.score, request)
        log_event(log, "scored", call_id=request.call_id[:128], items=len(response.results),
                  seconds=round(time.perf_counter() - started, 4))
        self.metrics["lockstep_scorer_items_total"].labels(SERVICE).inc(len(response.results))
        self.metrics["lockstep_scorer_seconds"].labels(SERVICE).observe(time.perf_counter() - started)
        return response

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        # ok means "this process answers RPCs"; whether a model is loaded is in status.
        if self.engine is None:
            return pb.HealthResponse(ok=True, status="not_loaded")
        return pb.HealthResponse(ok=True, status="busy" if self._lock.locked() else "serving")

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.ServiceInfo:
        return self._info()

    def _info(self) -> pb.ServiceInfo:
        engine = self.engine
        details = {"engine": self.config.engine, "engine_loaded": "false"}
        if engine is not None:
            details = {**engine.info(), "engine": self.engine_name, "engine_loaded": "true"}
            if self._scorer is not None:
                details["weights_sha256"] = self._scorer.weights_sha256
        details["role"] = self.config.role
        device = None
        with contextlib.suppress(ValueError):  # an engine whose model is in another process has no device here
            device = engine.broadcast_device() if engine is not None else None
        details.update(node_details(device))  # where an IPC handover can reach this replica
        return pb.ServiceInfo(
            service=SERVICE,
            version=package_version(),
            run_id=self.run_id,
            model_path=engine.model_path if engine is not None else "",
            policy_version=engine.policy_version if engine is not None else -1,
            details=details,
        )

    def close(self) -> None:
        # Let a batch still running in the worker finish before its engine goes away.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._ipc.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class RolloutService:
    """The process: one servicer in a GrpcServiceHost (gRPC, health, metrics server)."""

    def __init__(self, config: RolloutServiceConfig, token: BearerToken) -> None:
        self.config = config
        registry = CollectorRegistry()
        self.metrics = build_collectors(ROLLOUT_METRICS, registry)
        self.metrics["lockstep_rollout_policy_version"].labels(SERVICE).set(-1)
        self.servicer = RolloutServicer(config, self.metrics, token)
        self.host = GrpcServiceHost(
            SERVICE, lambda server: pb_grpc.add_RolloutServicer_to_server(self.servicer, server), token,
            host=config.host, grpc_port=config.grpc_port, metrics_port=config.metrics_port, registry=registry,
            shutdown_grace_s=config.shutdown_grace_s, logger=log)

    async def close(self) -> None:
        self.servicer.close()


async def serve(config: RolloutServiceConfig, token: BearerToken) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully (in-flight RPCs get shutdown_grace_s)."""
    service = RolloutService(config, token)
    await serve_until_signalled(service.host, close=service.close, default_engine=config.engine)
