"""What the coordinator does during and after a broadcast round (abort_reason and judge_round, pure): when the
trainer is told to give up on the group, who is evicted, whose answers are kept, when the rest are
regrouped, and when the run fails or waits for the trainer."""
from __future__ import annotations

import grpc
import pytest

from proto import lockstep_pb2 as pb
from services.coordinator.clients import TrainerUnavailable
from services.coordinator.run.errors import RunFailed
from services.coordinator.weight_sources import ABORT_REASON_CHARS, BroadcastRound, abort_reason, judge_round

PLAN = pb.BroadcastPlan(policy_version=4, group_name="g-4")
OK = pb.UpdateWeightsResponse(policy_version=4, total_sha256="d")


def _error(code: grpc.StatusCode, details: str = "x") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _judge(sent, received, may_regroup=True):
    return judge_round(BroadcastRound(PLAN, sent, received), may_regroup=may_regroup)


def test_a_completed_broadcast_keeps_every_reachable_replica_and_evicts_the_rest():
    v = _judge(OK, [OK, _error(grpc.StatusCode.UNAVAILABLE), OK])
    assert (v.evict, v.accept, v.regroup, v.failure) == ([1], [0, 2], [], None)


def test_a_broadcast_broken_by_an_unreachable_replica_regroups_the_others_once():
    aborted = _error(grpc.StatusCode.ABORTED, "rank 2 never joined")
    v = _judge(aborted, [_error(grpc.StatusCode.ABORTED), _error(grpc.StatusCode.DEADLINE_EXCEEDED)])
    assert (v.evict, v.accept, v.regroup, v.failure) == ([1], [], [0], None)
    again = _judge(aborted, [_error(grpc.StatusCode.ABORTED), _error(grpc.StatusCode.UNAVAILABLE)], may_regroup=False)
    assert again.evict == [1] and again.regroup == []
    with pytest.raises(RunFailed, match="version 4: weight broadcast g-4 failed: ABORTED: rank 2 never joined"):
        raise again.failure


def test_a_failure_with_every_replica_reachable_fails_the_run_and_a_lost_trainer_is_waited_for():
    refused = _error(grpc.StatusCode.PERMISSION_DENIED, "plan.rendezvous: not one of broadcast_sources")
    v = _judge(_error(grpc.StatusCode.ABORTED, "rank 2 never joined"), [_error(grpc.StatusCode.ABORTED), refused])
    assert v.evict == [] and v.regroup == [] and isinstance(v.failure, RunFailed)
    # The replica's refusal, the cause, is named beside the trainer's timeout.
    assert str(v.failure).endswith("ABORTED: rank 2 never joined; rank 1: ABORTED: x; rank 2: PERMISSION_DENIED: "
                                   "plan.rendezvous: not one of broadcast_sources")
    lost = TrainerUnavailable("trainer gone")
    assert _judge(lost, [_error(grpc.StatusCode.ABORTED)]).failure is lost
    # Nobody left to sync: the unreachable are evicted and the fleet waits for a replica to come back.
    v = _judge(_error(grpc.StatusCode.ABORTED), [_error(grpc.StatusCode.UNAVAILABLE)])
    assert (v.evict, v.accept, v.regroup, v.failure) == ([0], [], [], None)


ADDRESSES = ["10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"]


def test_the_trainer_is_told_to_give_up_once_any_replica_failed():
    # Nothing failed yet (still running, or received): the group may still form.
    assert abort_reason([None, None, None], ADDRESSES) is None
    assert abort_reason([OK, None, OK], ADDRESSES) is None
    # One refusal is enough: the trainer waits for every rank, so the others' join can never complete.
    refused = _error(grpc.StatusCode.PERMISSION_DENIED, "plan.rendezvous: not one of broadcast_sources")
    assert abort_reason([None, refused, None], ADDRESSES) == (
        "ReceiveWeights failed: rank 2 (10.0.0.2:7001): PERMISSION_DENIED: plan.rendezvous: not one of "
        "broadcast_sources")
    both = abort_reason([_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), None, refused], ADDRESSES)
    assert both.startswith("ReceiveWeights failed: rank 1 (10.0.0.1:7001): UNAVAILABLE: connection refused; "
                           "rank 3 (10.0.0.3:7001): PERMISSION_DENIED")
    # Bounded, whatever the replicas answered and however many there are.
    huge = [_error(grpc.StatusCode.FAILED_PRECONDITION, "x" * 100_000)] * 100
    assert len(abort_reason(huge, [f"10.0.0.{i}:7001" for i in range(100)])) == ABORT_REASON_CHARS

