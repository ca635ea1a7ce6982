"""The trainer's side of a broadcast round, against `python -m services.trainer` as a real process over
real gRPC, with gloo ranks in this process's threads reaching its rendezvous with the token.

Rank 0 waits at a join barrier in its rendezvous before it builds the process group, so a rank that never
comes no longer keeps it (under the servicer's lock) for the whole weight_broadcast_timeout_s: an
AbortWeightBroadcast, served beside the running broadcast, makes RunWeightBroadcast fail at once naming the
ranks that never joined and why, and releases the ranks that did join. The timeouts here are 600 s, so
every bound below is far from what waiting them out would take.

The rendezvous itself, under attack: it listens on the configured 127.0.0.1 only; a caller without the
token reads and writes nothing, the join barrier's 'abandoned' key included, and does not make the trainer
hold one of its values; a caller with it is held to the configured limits; and a broadcast with an
intruder hammering the rendezvous throughout completes with every digest that of the GetWeights stream.
"""
from __future__ import annotations

import json
import threading
import time

import grpc
import psutil
import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.process.ports import free_port
from services.common.rendezvous.key_table import GroupClosed, StoreFull
from services.common.rendezvous.store import RendezvousClient
from services.common.weights.broadcast_protocol import joined_key
from services.rollout.weights.broadcast_receiver import BroadcastReceiveFailed, checked_plan, receive_broadcast
from tests.support.rendezvous import Intruder, listening_ips
from tests.trainer.test_trainer_server import TOKEN, trainer_process

RUN = "abort"
TIMEOUT_S = 600
# A round the abort ends is over within this long; waiting out the timeouts would take TIMEOUT_S.
PROMPT_S = 60
# The rendezvous' limits here: ample for a group of three ranks (about ten keys of a few hundred bytes).
MAX_KEYS, MAX_VALUE_BYTES, MAX_STORE_BYTES = 64, 64 * 1024, 256 * 1024


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_model_dir):
    address = f"127.0.0.1:{free_port()}"
    env = {"LOCKSTEP_TRAINER_WEIGHT_BROADCAST_ADDRESS": address,
           "LOCKSTEP_TRAINER_WEIGHT_BROADCAST_TIMEOUT_S": str(TIMEOUT_S),
           "LOCKSTEP_TRAINER_WEIGHT_BROADCAST_MAX_KEYS": str(MAX_KEYS),
           "LOCKSTEP_TRAINER_WEIGHT_BROADCAST_MAX_VALUE_BYTES": str(MAX_VALUE_BYTES),
           "LOCKSTEP_TRAINER_WEIGHT_BROADCAST_MAX_STORE_BYTES": str(MAX_STORE_BYTES)}
    for stub, proc, _metrics in trainer_process(tmp_path_factory.getbasetemp(), env):
        stub.ConfigureRun(pb.ConfigureRunRequest(run_id=RUN, model_path=str(tiny_model_dir), seed=1,
                                                 trainer_config_json=json.dumps({"lr": 1e-2})), timeout=120)
        yield stub, address, proc.pid


class Call(threading.Thread):
    """`fn()` in a thread: its result or exception once joined."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc

    def outcome(self, timeout_s: float = PROMPT_S):
        self.join(timeout_s)
        assert not self.is_alive(), f"still running after {timeout_s} s"
        return self.error or self.result


def _receive(plan: pb.BroadcastPlan, rank: int):
    """A replica's side, reaching the rendezvous with the deployment's token."""
    request = pb.ReceiveWeightsRequest(plan=plan, rank=rank)

    def receive():
        store = RendezvousClient(plan.rendezvous, TOKEN, TIMEOUT_S)
        try:
            return receive_broadcast(request, checked_plan(request), torch.device("cpu"), store, TIMEOUT_S)
        finally:
            store.close()

    return receive


def _abort(stub, group_name: str, reason: str, run_id: str = RUN) -> bool:
    return stub.AbortWeightBroadcast(pb.AbortWeightBroadcastRequest(run_id=run_id, group_name=group_name,
                                                                    reason=reason), timeout=30).aborted


def test_every_rank_joined_is_broadcast_whole_and_an_abort_afterwards_changes_nothing(trainer):
    stub, address, _ = trainer
    plan = stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=1, digest_trailer=True),
                                    timeout=60)
    assert plan.rendezvous == address and plan.world_size == 2
    sending = Call(lambda: stub.RunWeightBroadcast(pb.RunWeightBroadcastRequest(
        run_id=RUN, group_name=plan.group_name), timeout=TIMEOUT_S))
    got = Call(_receive(plan, 1)).outcome()
    sent = sending.outcome()
    assert not isinstance(got, Exception) and not isinstance(sent, Exception), (got, sent)
    assert got.total_sha256 == sent.total_sha256 and sent.policy_version == 0 and len(got.tensors) == sent.tensors
    # Done, unknown, or another run's: a no-op, answered as such.
    assert _abort(stub, plan.group_name, "late") is False
    assert _abort(stub, "lockstep-weights-unknown", "never planned") is False


def test_an_abort_ends_a_round_whose_rank_never_joins_naming_it_and_the_reason(trainer):
    stub, address, _ = trainer
    plan = stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=2, digest_trailer=True),
                                    timeout=60)
    assert _abort(stub, plan.group_name, "wrong run", run_id="other") is False
    started = time.monotonic()
    sending = Call(lambda: stub.RunWeightBroadcast(pb.RunWeightBroadcastRequest(
        run_id=RUN, group_name=plan.group_name), timeout=TIMEOUT_S))
    joined = Call(_receive(plan, 1))  # rank 2 never comes
    store = RendezvousClient(address, TOKEN, 60)
    while not store.check([joined_key(plan.group_name, 1)]):
        assert time.monotonic() - started < PROMPT_S and sending.is_alive()
        time.sleep(0.05)
    assert stub.Health(pb.HealthRequest(), timeout=10).status == "busy"  # the broadcast holds the lock
    # Answered beside the broadcast holding the servicer's lock.
    assert _abort(stub, plan.group_name, "rank 2 (127.0.0.1:1): PERMISSION_DENIED: not in broadcast_sources")

    sent, got = sending.outcome(), joined.outcome()
    assert isinstance(sent, grpc.RpcError) and sent.code() == grpc.StatusCode.ABORTED, sent
    assert f"broadcast {plan.group_name} of version 0 to 2 replicas failed" in sent.details()
    assert "rank 2 of 3 never joined: aborted: rank 2 (127.0.0.1:1): PERMISSION_DENIED" in sent.details()
    # The rank that did join is released with the trainer's reason, having applied nothing.
    assert isinstance(got, BroadcastReceiveFailed), got
    assert "rank 0 abandoned it: aborted: rank 2 (127.0.0.1:1): PERMISSION_DENIED" in str(got)
    assert stub.Health(pb.HealthRequest(), timeout=10).status == "serving"


def test_a_group_aborted_before_it_runs_fails_at_once_and_an_abort_needs_a_reason(trainer):
    stub, _, _ = trainer
    plan = stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=1, digest_trailer=True),
                                    timeout=60)
    with pytest.raises(grpc.RpcError) as refused:
        _abort(stub, plan.group_name, "")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reason: required" in refused.value.details()
    assert _abort(stub, plan.group_name, "rank 1 (127.0.0.1:1): UNAVAILABLE: gone")
    failed = Call(lambda: stub.RunWeightBroadcast(pb.RunWeightBroadcastRequest(
        run_id=RUN, group_name=plan.group_name), timeout=TIMEOUT_S)).outcome()
    assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.ABORTED
    assert "rank 1 of 2 never joined: aborted: rank 1 (127.0.0.1:1): UNAVAILABLE: gone" in failed.details()


# ------------------------------------------------------------------ the rendezvous under attack --

def _weights_digest(stub) -> str:
    return list(stub.GetWeights(pb.GetWeightsRequest(run_id=RUN), timeout=120))[-1].total_sha256


def test_the_rendezvous_listens_on_the_configured_host_only(trainer):
    _, address, pid = trainer
    # torch's TCPStore, which it replaced, listened on every interface ("::") whatever the host.
    assert listening_ips(pid, int(address.rpartition(":")[2])) == ["127.0.0.1"]


def test_a_caller_without_the_token_reads_writes_and_parks_nothing(trainer):
    stub, address, pid = trainer
    plan = stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=1, digest_trailer=True),
                                    timeout=60)
    ours = RendezvousClient(address, TOKEN, 30)
    probe = f"{plan.group_name}/probe"
    ours.set(probe, b"ours")
    intruder = Intruder(address, [plan.group_name], value_bytes=64 << 20)
    process = psutil.Process(pid)
    before = process.memory_info().rss
    for _ in range(4):  # every operation, the 'abandoned' key included, and 64 MiB values, tokenless
        intruder.round()
    grown = process.memory_info().rss - before
    intruder.stop()
    assert intruder.attempts == 4 * 13 and intruder.accepted == []
    # Nothing the intruder sent was kept, or even held whole: one of its values is 64 MiB.
    assert grown < len(intruder.value), f"trainer RSS grew {grown / 2**20:.0f} MiB"
    assert ours.get(probe) == b"ours" and ours.num_keys() == 1
    assert not ours.check([f"{plan.group_name}/abandoned"])

    # With the token, the configured limits hold: nothing past them is stored.
    with pytest.raises(StoreFull, match="max_value_bytes"):
        ours.set(f"{plan.group_name}/large", b"x" * (MAX_VALUE_BYTES + 1))
    stored, value = 1, b"x" * 1024
    with pytest.raises(StoreFull, match="max_keys|max_bytes"):
        for i in range(MAX_KEYS + 1):
            ours.set(f"{plan.group_name}/fill/{i:04d}", value)
            stored += 1
    assert ours.num_keys() == stored <= MAX_KEYS and stored * len(value) <= MAX_STORE_BYTES
    # A newer plan closes the group: its keys go, and a late caller learns why.
    stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=1, digest_trailer=True), timeout=60)
    assert ours.num_keys() == 0
    with pytest.raises(GroupClosed, match="replaced by the newer plan"):
        ours.get_now(probe)
    ours.close()


def test_a_broadcast_with_an_intruder_hammering_the_rendezvous_completes_whole(trainer):
    stub, address, _ = trainer
    expected = _weights_digest(stub)
    plan = stub.OpenWeightBroadcast(pb.OpenWeightBroadcastRequest(run_id=RUN, replicas=2, digest_trailer=True),
                                    timeout=60)
    intruder = Intruder(address, [plan.group_name])
    intruder.start()
    try:
        sending = Call(lambda: stub.RunWeightBroadcast(pb.RunWeightBroadcastRequest(
            run_id=RUN, group_name=plan.group_name), timeout=TIMEOUT_S))
        ranks = [Call(_receive(plan, rank)) for rank in (1, 2)]
        got, sent = [r.outcome() for r in ranks], sending.outcome()
    finally:
        intruder.stop()
    assert not any(isinstance(x, Exception) for x in (*got, sent)), (got, sent)
    assert [g.total_sha256 for g in got] == [sent.total_sha256] * 2 and sent.total_sha256 == expected
    assert intruder.attempts > 13 and intruder.accepted == []
