"""Which weights version the trainer serves (GetWeights, WriteWeights), and when it stops serving it.

The servicer's lock serializes every call that reads or changes the weights (a run has one model). The
last version cut (services/trainer/weights/served_weights.py: a host copy, hashed and encoded on pools)
is kept for the other replicas while the weights it was cut from are current, or after a TrainStep that
kept it (keep_previous_weights): a request for that version is answered from the copy without waiting
for the step holding the lock. A call that changes the weights otherwise (ConfigureRun, LoadCheckpoint,
a TrainStep that keeps nothing) withdraws it; its host buffer is then written over by the next cut.

GetWeights' chunks are serialized once, when encoded, and sent as those bytes:
`WeightChunksAsKept` registers its handler without a response serializer.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from services.trainer.data.wire import FailedPrecondition, StepRequest
from services.trainer.run_state import RunState, WeightSnapshot
from services.trainer.weights.served_weights import DEFAULT_CUT_WORKERS, VersionRetired, WeightVersion

T = TypeVar("T")

# How often a request for a version waits for the trainer's lock before it looks again for that version
# kept by the TrainStep holding the lock.
KEPT_POLL_S = 0.05


class VersionNotKept(FailedPrecondition):
    """GetWeights or WriteWeights named a version the trainer neither holds nor kept: NOT_FOUND, so that a
    replica tells it from a trainer that lost the run (FAILED_PRECONDITION, which the run recovers from)."""


class WeightSource(Protocol):
    """What serving needs of the trainer (a Trainer, or a data-parallel group's rank 0)."""

    run: RunState | None

    def require_run(self, run_id: str) -> RunState: ...

    def weight_tensors(self, run_id: str) -> WeightSnapshot: ...

    def check_weights_unchanged(self, snapshot: WeightSnapshot) -> None: ...


@dataclass
class ServedWeights:
    """One weights state's GetWeights stream: `snapshot` identifies the state, `version` holds its bytes and
    chunk digests for every replica that reads it. `withdrawn`: the trainer's weights were replaced other
    than by a step from this state (ConfigureRun, LoadCheckpoint, a TrainStep that did not keep it), so it
    is no longer the run's version `snapshot.policy_version`."""

    snapshot: WeightSnapshot
    chunk_bytes: int
    version: WeightVersion
    withdrawn: bool = False


class WeightServing:
    """The served version of `trainer`'s weights, guarded by `lock` (the servicer's, which every call
    touching the weights holds); `chunk_bytes`: the chunk size of a version cut for a TrainStep, and of a
    request that names none."""

    def __init__(self, trainer: WeightSource, lock: threading.Lock, *, chunk_bytes: int) -> None:
        self.trainer = trainer
        self.lock = lock
        self.chunk_bytes = chunk_bytes
        # The last version cut (GetWeights, WriteWeights, a TrainStep keeping its previous weights), kept for
        # other replicas; while the weights it was cut from are current, or after a TrainStep that kept it.
        self.served: ServedWeights | None = None
        # The version a weight change retired: its host buffer is written over by the next cut.
        self._retired: WeightVersion | None = None
        self._hash_pool = ThreadPoolExecutor(DEFAULT_CUT_WORKERS, thread_name_prefix="weights-hash")
        self._encode_pool = ThreadPoolExecutor(DEFAULT_CUT_WORKERS, thread_name_prefix="weights-encode")

    def close(self) -> None:
        self.served = self._retired = None
        for pool in (self._hash_pool, self._encode_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    def changing_weights(self, fn: Callable[..., T], *args: object) -> T:
        """(Under the lock.) `fn`, a call that may change the weights: the kept version of the old ones is no
        longer served; its host memory is kept for the next version's cut (one host copy of the weights,
        which the trainer holds between syncs anyway)."""
        self.withdraw()
        return fn(*args)

    def withdraw(self) -> None:
        """(Under the lock.) Stop serving the kept version."""
        if self.served is not None:
            self.served.withdrawn = True
            self._retired, self.served = self.served.version, None

    def before_step(self, req: StepRequest) -> None:
        """(Under the lock, before TrainStep `req` runs.) With keep_previous_weights, the weights the step
        starts from (version step - 1) are cut first and stay served by version while it trains; otherwise
        they are withdrawn."""
        run = self.trainer.run
        if not req.keep_previous_weights:
            self.withdraw()
        elif run is not None and run.run_id == req.run_id and run.policy_version == req.step - 1:
            self._current(req.run_id, self.chunk_bytes)
        # else: a replay or a refused step, which leaves the weights as they are

    def hold(self, run_id: str, version: int | None, chunk_bytes: int) -> ServedWeights:
        """(In a worker thread.) The weights to send or write, held (the caller releases them): `version` of
        the run, from the trainer's current weights or the copy a TrainStep kept; with None, the current
        weights. FailedPrecondition when the trainer has neither (VersionNotKept for a version it neither
        holds nor kept). A kept version is found without the lock, so that it is served while the step
        that kept it trains."""
        if version is not None:
            while not self.lock.acquire(timeout=KEPT_POLL_S):
                if (kept := self._kept(run_id, version, chunk_bytes)) is not None:
                    return kept
        else:
            self.lock.acquire()
        try:
            if version is not None:
                if (kept := self._kept(run_id, version, chunk_bytes)) is not None:
                    return kept
                current = self.trainer.require_run(run_id).policy_version
                if current != version:
                    raise VersionNotKept(f"policy_version: the trainer holds version {current} of run {run_id!r} "
                                         f"and keeps no copy of version {version} (in chunks of {chunk_bytes} bytes)")
            served = self._current(run_id, chunk_bytes)
            served.version.acquire()
            return served
        finally:
            self.lock.release()

    async def chunks(self, served: ServedWeights, wanted: int | None) -> AsyncIterator[bytes]:
        """The serialized WeightChunks of `served` (held by the caller: released once the stream holds it).

        The version is a snapshot: a step that changes the live weights mid-stream cannot tear it. A stream
        of the current weights (`wanted` None) fails (FailedPrecondition) if they change before it ends,
        rather than hand out a version the trainer has moved past; one of a named version fails only if the
        version is withdrawn."""
        try:
            reader = served.version.reader()
        finally:
            served.version.release()
        try:
            while (upcoming := reader.next_chunk()) is not None:
                chunk = await asyncio.wrap_future(upcoming)
                if wanted is None:
                    self.trainer.check_weights_unchanged(served.snapshot)
                elif served.withdrawn:
                    raise FailedPrecondition(f"weights of policy_version {wanted} were replaced (the trainer was "
                                             "configured or loaded a checkpoint) while they were being read")
                yield chunk
        finally:
            reader.close()

    def _kept(self, run_id: str, version: int, chunk_bytes: int) -> ServedWeights | None:
        """The served `version` of the run, held (the caller releases it), or None."""
        served = self.served
        if (served is None or served.withdrawn or served.snapshot.run.run_id != run_id
                or served.snapshot.policy_version != version or served.chunk_bytes != chunk_bytes):
            return None
        try:
            served.version.acquire()
        except VersionRetired:
            return None
        return served

    def _current(self, run_id: str, chunk_bytes: int) -> ServedWeights:
        """The run's current weights as served (under the lock): the version kept from an earlier GetWeights
        while the weights are unchanged, else a new one cut now (copied to host memory before the lock is
        let go; hashed on the pool as the stream goes)."""
        served = self.served
        if served is not None and served.chunk_bytes == chunk_bytes and served.snapshot.run.run_id == run_id:
            try:
                self.trainer.check_weights_unchanged(served.snapshot)
                return served
            except FailedPrecondition:
                pass
        retired = self.served.version if self.served is not None else self._retired
        self.served = self._retired = None
        snapshot = self.trainer.weight_tensors(run_id)
        version = WeightVersion(snapshot.tensors, run_id=run_id, policy_version=snapshot.policy_version,
                                chunk_bytes=chunk_bytes, lora=snapshot.lora, hash_pool=self._hash_pool,
                                encode_pool=self._encode_pool, reuse=retired)
        del snapshot.tensors[:]  # the compute-dtype casts (on a GPU, device memory) go now
        self.served = ServedWeights(dataclasses.replace(snapshot, tensors=[]), chunk_bytes, version)
        return self.served


class WeightChunksAsKept:
    """A server as add_TrainerServicer_to_server sees it: GetWeights' handler is registered without a
    response serializer (its chunks are serialized once, when cut, and sent as the kept bytes); every other
    handler is registered unchanged. The generated code registers the same handlers twice, as a generic
    handler and by method name; both are made here from the by-name ones (a trainer without them serves
    nothing, which every test of it would show)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # made from the by-name handlers below

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        get = handlers["GetWeights"]
        handlers = {**handlers, "GetWeights": grpc.unary_stream_rpc_method_handler(
            get.unary_stream, request_deserializer=get.request_deserializer)}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)
