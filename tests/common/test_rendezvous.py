"""The weight-broadcast rendezvous: its key table (pure), and its gRPC server and client between real
sockets of this process.

The table answers torch's store operations as torch's own stores do (HashStore is the reference), holds
keys of open groups only, drops a group's keys when it closes and tells late askers why, and refuses any
write past a limit storing nothing. Over the network, every method refuses a caller without the
deployment's token, and a message larger than the limits allow is not received at all.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import grpc
import pytest
import torch.distributed as dist

from proto import rendezvous_pb2 as rpb
from proto import rendezvous_pb2_grpc as rpb_grpc
from services.common.auth import BearerToken, generate_token
from services.common.grpc.options import sync_channel
from services.common.rendezvous.key_table import (
    MAX_KEY_BYTES,
    GroupClosed,
    KeyRefused,
    KeyTable,
    RendezvousLimits,
    StoreFull,
)
from services.common.rendezvous.service import RendezvousServer, max_message_bytes
from services.common.rendezvous.store import LocalStore
from tests.support.rendezvous import HostedRendezvous, listening_ips


def _table(**limits) -> KeyTable:
    table = KeyTable(RendezvousLimits(**limits))
    table.open_group("g")
    return table


def _ops(store) -> list:
    """One sequence of every operation, with the answers a torch store gives."""
    out = [store.compare_set("g/k", b"", b"v"), store.compare_set("g/k", b"x", b"w"),
           store.compare_set("g/k", b"v", b"w"), store.compare_set("g/unset", b"e", b"d"),
           store.check(["g/unset"]), store.add("g/c", 2), store.add("g/c", 5), store.get("g/c")]
    store.set("g/s", b"abc")
    out += [store.get("g/s"), store.check(["g/s", "g/k"]), store.delete_key("g/c"), store.delete_key("g/c"),
            store.num_keys()]
    return out


def test_the_table_answers_as_torchs_own_store_does():
    ours = _ops(LocalStore(_table(), timeout_s=1))
    assert ours == _ops(dist.HashStore())
    assert ours[:3] == [b"v", b"v", b"w"] and ours[5:8] == [2, 7, b"7"]


def test_keys_of_no_open_group_are_refused_and_a_closed_groups_reason_is_told():
    table = _table()
    for key in ("h/x", "nogroup", "/g/x", "x" * (MAX_KEY_BYTES + 1)):
        with pytest.raises(KeyRefused):
            table.set(key, b"1")
        with pytest.raises(KeyRefused):
            table.wait([key], 0.0)
        assert table.check([key]) is False  # never set: what NCCL's watchdog asks of its own key
    table.set("g/a", b"12")
    table.set("g/g//cpu//0/0", b"addr")
    assert table.num_keys() == 2 and table.bytes_held == len("g/a") + 2 + len("g/g//cpu//0/0") + 4
    table.close_group("g", "rank 2 never joined")
    assert table.num_keys() == 0 and table.bytes_held == 0
    with pytest.raises(GroupClosed, match="group g is closed: rank 2 never joined") as closed:
        table.check(["g/a"])
    assert closed.value.reason == "rank 2 never joined"
    table.open_group("g")  # a group opened again under the name starts empty
    assert table.get("g/a") is None


def test_a_wait_ends_when_its_keys_are_set_or_their_group_closes():
    table = _table()
    assert table.wait(["g/a"], 0.0) is False
    threading.Timer(0.05, table.set, ("g/a", b"1")).start()
    assert table.wait(["g/a"], 60.0) is True
    threading.Timer(0.05, table.close_group, ("g", "aborted: gone")).start()
    with pytest.raises(GroupClosed, match="aborted: gone"):
        table.wait(["g/b"], 60.0)


@pytest.mark.parametrize(("limits", "writes", "refused"), [
    ({"max_value_bytes": 8}, [("g/a", 8), ("g/b", 9)], "g/b"),
    ({"max_keys": 2}, [("g/a", 1), ("g/b", 1), ("g/a", 2), ("g/c", 1)], "g/c"),
    ({"max_bytes": 20}, [("g/a", 5), ("g/b", 5), ("g/a", 9), ("g/c", 1)], "g/c"),
])
def test_a_write_past_a_limit_is_refused_and_stores_nothing(limits, writes, refused):
    table = _table(**limits)
    for key, size in writes[:-1]:
        table.set(key, b"x" * size)
    before = (table.num_keys(), table.bytes_held, table.get("g/a"))
    key, size = writes[-1]
    with pytest.raises(StoreFull):
        table.set(key, b"x" * size)
    assert key == refused and (table.num_keys(), table.bytes_held, table.get("g/a")) == before
    assert table.bytes_held <= table.limits.max_bytes and table.num_keys() <= table.limits.max_keys
    with pytest.raises(StoreFull):
        table.compare_set("g/a", before[2], b"y" * (table.limits.max_value_bytes + 1))
    assert table.get("g/a") == before[2]


# ------------------------------------------------------------------ over gRPC --

REQUESTS = {"Set": rpb.SetRequest(key="g/a", value=b"1"), "Get": rpb.KeyRequest(key="g/a"),
            "Add": rpb.AddRequest(key="g/n", delta=1),
            "CompareSet": rpb.CompareSetRequest(key="g/a", expected=b"1", desired=b"2"),
            "Check": rpb.KeysRequest(keys=["g/a"]), "Wait": rpb.WaitRequest(keys=["g/a"], wait_ms=10),
            "DeleteKey": rpb.KeyRequest(key="g/a"), "NumKeys": rpb.NumKeysRequest()}


def test_every_method_of_the_service_is_in_the_refusal_check():
    assert set(REQUESTS) == {m.name for m in rpb.DESCRIPTOR.services_by_name["Rendezvous"].methods}


@pytest.mark.parametrize("credentials", ["none", "wrong"])
def test_a_caller_without_the_token_can_neither_read_nor_write(credentials):
    with HostedRendezvous("g") as rendezvous:
        rendezvous.table.set("g/a", b"secret")
        if credentials == "none":
            channel = grpc.insecure_channel(rendezvous.address)
        else:
            channel = sync_channel(rendezvous.address, BearerToken(generate_token()))
        stub = rpb_grpc.RendezvousStub(channel)
        try:
            for method, request in REQUESTS.items():
                with pytest.raises(grpc.RpcError) as refused:
                    getattr(stub, method)(request, timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        finally:
            channel.close()
        assert rendezvous.table.get("g/a") == b"secret" and rendezvous.table.num_keys() == 1


def test_a_message_past_the_limits_is_not_received_from_anyone():
    limits = RendezvousLimits(max_value_bytes=64 * 1024)
    with HostedRendezvous("g", limits=limits) as rendezvous:
        too_large = b"x" * (max_message_bytes(limits.max_value_bytes) + 1)
        for token in (rendezvous.token, BearerToken(generate_token())):
            channel = sync_channel(rendezvous.address, token)
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    rpb_grpc.RendezvousStub(channel).Set(rpb.SetRequest(key="g/a", value=too_large), timeout=30)
            finally:
                channel.close()
            assert refused.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)
        # With the token, a value past max_value_bytes but within a message: refused by the table.
        client = rendezvous.client(5)
        with pytest.raises(StoreFull, match="max_value_bytes"):
            client.set("g/a", b"x" * (limits.max_value_bytes + 1))
        assert rendezvous.table.num_keys() == 0 and rendezvous.table.bytes_held == 0


def test_the_client_is_a_torch_store_that_waits_and_learns_why_a_group_closed():
    with HostedRendezvous("g") as rendezvous:
        client = rendezvous.client(timeout_s=60)
        assert _ops(client) == _ops(dist.HashStore()) and rendezvous.table.get("g/s") == b"abc"
        with pytest.raises(dist.DistStoreError, match="not set within 0.2 s"):
            client.wait(["g/never"], timedelta(seconds=0.2))
        threading.Timer(0.1, rendezvous.table.set, ("g/late", b"1")).start()
        assert client.get("g/late") == b"1"  # get waits for its key
        with pytest.raises(KeyRefused, match="FAILED_PRECONDITION"):
            client.set("other/a", b"1")
        threading.Timer(0.1, rendezvous.table.close_group, ("g", "aborted: rank 2 is gone")).start()
        with pytest.raises(GroupClosed, match="aborted: rank 2 is gone"):
            client.get("g/never")
        client.close()


def test_the_server_listens_on_its_configured_host_only_and_does_not_share_its_port():
    with HostedRendezvous("g") as rendezvous:
        assert listening_ips(os.getpid(), int(rendezvous.address.rpartition(":")[2])) == ["127.0.0.1"]
        second = RendezvousServer(KeyTable(RendezvousLimits()), rendezvous.token, rendezvous.address,
                                  field="weight_broadcast_address")
        with pytest.raises(OSError, match=f"weight_broadcast_address: cannot listen on {rendezvous.address}"):
            second.start()
