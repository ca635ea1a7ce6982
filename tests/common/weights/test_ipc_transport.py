"""The IPC handover's layout, handle checks and digest, and its CPU transport with a real second process.

The CPU transport (POSIX shared memory through torch's file_system sharing) is the one the CUDA transport
stands beside in services/common/weights/ipc_transport.py: the same layout, the same proto fields checked the
same way, the same digest. A second process maps what the trainer's handover host shared, hashes it and reads
it back; the refusals are what check_handles and the host say for a handover that is not the caller's.
"""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.weights import ipc_transport as ipc
from services.common.weights.bucket_digest import BucketHasher, block_ranges, leaf_plan, pieces
from services.common.weights.digest import DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES, tensors_digest
from services.common.weights.ipc_transport import align


def test_layout_aligns_every_tensor_and_cuts_buckets_at_the_size():
    tensors = [("a", "bfloat16", (3,), 6), ("b", "float32", (5,), 20), ("c", "float32", (100,), 400),
               ("d", "bfloat16", (1000,), 2000), ("e", "int64", (2,), 16)]
    buckets = ipc.plan_layout(tensors, 512)
    assert [[s.name for s in b.slots] for b in buckets] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [s.offset for s in buckets[0].slots] == [0, 256]
    assert buckets[0].nbytes == 276 and buckets[2].nbytes == 2000  # a tensor larger than the size goes alone
    for bucket in buckets:
        assert all(s.offset % ipc.ALIGN_BYTES == 0 for s in bucket.slots)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ipc.plan_layout(tensors, 100)


def test_digest_blocks_follow_each_tensor_from_its_start():
    layout = ipc.BucketLayout((ipc.TensorSlot("a", "uint8", (10,), 0, 10),
                               ipc.TensorSlot("b", "uint8", (DIGEST_BLOCK_BYTES + 5,), 256, DIGEST_BLOCK_BYTES + 5)),
                              256 + DIGEST_BLOCK_BYTES + 5)
    assert block_ranges(layout) == [(0, 10), (256, 256 + DIGEST_BLOCK_BYTES),
                                    (256 + DIGEST_BLOCK_BYTES, 256 + DIGEST_BLOCK_BYTES + 5)]
    assert pieces([(0, 4), (4, 8), (8, 20), (20, 22)], 10) == [[(0, 4), (4, 8)], [(8, 20)], [(20, 22)]]


def test_masters_are_cast_into_their_slots_as_they_are_packed():
    g = torch.Generator().manual_seed(3)
    masters = [("w", torch.randn(300, 7, generator=g)), ("ids", torch.arange(5)), ("b", torch.randn(9, generator=g))]
    layouts = ipc.layout_of(masters, 1 << 20, torch.bfloat16)
    assert [(s.name, s.dtype, s.nbytes) for s in layouts[0].slots] == [("w", "bfloat16", 4200), ("ids", "int64", 40),
                                                                       ("b", "bfloat16", 18)]
    buffer = ipc.allocate(layouts[0].nbytes, torch.device("cpu"))
    ipc.pack(buffer, layouts[0], [t for _, t in masters])
    for (name, view), (_, master) in zip(ipc.bucket_views(buffer, layouts[0]), masters):
        expected = master.to(torch.bfloat16) if master.is_floating_point() else master
        assert view.dtype == expected.dtype and view.view(-1).view(torch.uint8).equal(
            expected.reshape(-1).view(torch.uint8)), name


def test_leaf_plan_puts_whole_leaves_on_the_device_and_only_shorter_last_leaves_on_the_host():
    leaf = DIGEST_LEAF_BYTES
    big = DIGEST_BLOCK_BYTES + 2 * leaf + 6  # a whole block, then a short block of 2 whole leaves and 6 bytes
    layout = ipc.BucketLayout((ipc.TensorSlot("a", "uint8", (10,), 0, 10),
                               ipc.TensorSlot("empty", "uint8", (0,), 256, 0),
                               ipc.TensorSlot("b", "uint8", (big,), 256, big),
                               ipc.TensorSlot("c", "uint8", (leaf,), 256 + align(big), leaf)),
                              256 + align(big) + leaf)
    whole_block = list(range(256, 256 + DIGEST_BLOCK_BYTES, leaf))
    tail = 256 + DIGEST_BLOCK_BYTES
    assert leaf_plan(layout) == [([], (0, 10)), ([], (256, 256)), (whole_block, None),
                                 ([tail, tail + leaf], (tail + 2 * leaf, tail + 2 * leaf + 6)),
                                 ([256 + align(big)], None)]
    assert len(whole_block) == DIGEST_BLOCK_BYTES // leaf == 16


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(3000, 700, generator=g).to(torch.bfloat16)),  # > one digest block
            ("norm", torch.randn(7, generator=g)),
            ("head", torch.randn(33, 5, generator=g).to(torch.bfloat16))]


def test_bucket_digest_is_the_streams_digest():
    named = _named(0)
    layouts = ipc.layout_of(named, 1 << 20)
    buffers = [torch.zeros(lay.nbytes, dtype=torch.uint8) for lay in layouts]
    start = 0
    for buffer, layout in zip(buffers, layouts):
        ipc.pack(buffer, layout, [t for _, t in named[start:start + len(layout.slots)]])
        start += len(layout.slots)
    hasher = BucketHasher(2)
    try:
        assert hasher.digest(buffers, layouts) == tensors_digest(named)[0]
        buffers[-1][-1] ^= 1  # one bit of the last tensor
        assert hasher.digest(buffers, layouts) != tensors_digest(named)[0]
    finally:
        hasher.close()


class _Trainer:
    """The two calls the handover host makes of a trainer (a unit of the host's logic, not a trainer)."""

    def __init__(self, named, version: int) -> None:
        self.named, self.version = named, version

    def weight_tensors(self, run_id: str, *, cast: bool = True):  # the tensors as given, whatever `cast` says
        from services.trainer.run_state import WeightSnapshot
        return WeightSnapshot(None, 0, self.version, list(self.named))

    def check_weights_unchanged(self, snapshot) -> None:
        pass


def _map_in_child(raw: bytes, node: str, out) -> None:
    """The replica's part, in another process: check, map, hash, read back."""
    handles = pb.WeightHandles.FromString(raw)
    try:
        layouts = ipc.check_handles(handles, run_id="r", policy_version=handles.policy_version,
                                    handover_id=handles.handover_id, current_version=0, node=node)
        mapped = [ipc.open_bucket(handles.backend, b, -1) for b in handles.buckets]
        hasher = BucketHasher(1)
        digest = hasher.digest(mapped, layouts)
        hasher.close()
        views = [v for m, lay in zip(mapped, layouts) for v in ipc.bucket_views(m, lay)]
        out.put((digest, {name: t.float().sum().item() for name, t in views}, os.getpid()))
    except Exception as exc:  # reported to the test rather than lost with the child
        out.put(("error", repr(exc), os.getpid()))


@pytest.fixture
def host():
    import logging

    from services.trainer.weights.ipc_sender import WeightHandoverHost
    named = _named(1)
    made = WeightHandoverHost(_Trainer(named, 3), bucket_bytes=1 << 20, logger=logging.getLogger("test"),
                              hash_threads=1)
    made.named = named
    yield made
    made.close()


@pytest.mark.slow  # a spawned interpreter importing torch
def test_a_second_process_maps_the_handover_and_the_trainer_frees_it_once_released(host):
    opened = host.open(pb.OpenWeightHandoverRequest(run_id="r", replicas=1))
    assert (opened.backend, opened.policy_version, opened.tensors, opened.buckets) == ("cpu_shm", 3, 3, 2)
    handles = host.handles(pb.GetWeightHandlesRequest(run_id="r", policy_version=3, handover_id=opened.handover_id,
                                                      node_id=ipc.node_id()))
    names = [b.shm_name for b in handles.buckets]
    assert all(os.path.exists(b"/dev/shm" + n) for n in names)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_map_in_child, args=(handles.SerializeToString(), ipc.node_id(), out))
    child.start()
    digest, sums, pid = out.get(timeout=120)
    child.join(timeout=60)
    assert pid != os.getpid() and digest != "error", sums
    assert digest == tensors_digest(host.named)[0]
    assert sums == {name: t.float().sum().item() for name, t in host.named}
    verified = host.verify(pb.VerifyWeightHandoverRequest(run_id="r", handover_id=opened.handover_id,
                                                          share_id=handles.share_id, total_sha256=digest))
    assert verified.total_sha256 == digest
    assert host.release(pb.ReleaseWeightHandlesRequest(
        run_id="r", handover_id=opened.handover_id, share_id=handles.share_id,
        mapped_buckets=len(handles.buckets))).outstanding == 0
    # Every replica released its share: the buckets are gone, and the handover with them.
    assert not any(os.path.exists(b"/dev/shm" + n) for n in names)
    with pytest.raises(Exception, match="handover_id"):
        host.handles(pb.GetWeightHandlesRequest(run_id="r", policy_version=3, handover_id=opened.handover_id,
                                                node_id=ipc.node_id()))


def test_the_trainer_hands_handles_only_to_its_node_run_version_and_share_count(host):
    from services.trainer.weights.ipc_sender import HandoverRefused
    opened = host.open(pb.OpenWeightHandoverRequest(run_id="r", replicas=1))
    ask = dict(run_id="r", policy_version=3, handover_id=opened.handover_id, node_id=ipc.node_id())
    for field, value, reason in [("node_id", "another-boot/ipc:[1]", "node_id"),
                                 ("handover_id", "f" * 32, "handover_id"), ("run_id", "other", "handover_id"),
                                 ("policy_version", 2, "policy_version")]:
        with pytest.raises(HandoverRefused, match=reason):
            host.handles(pb.GetWeightHandlesRequest(**{**ask, field: value}))
    share = host.handles(pb.GetWeightHandlesRequest(**ask)).share_id
    with pytest.raises(HandoverRefused, match="shares"):
        host.handles(pb.GetWeightHandlesRequest(**ask))
    from services.trainer.data.wire import InvalidRequest
    for field, value, error in [("share_id", "0" * 16, HandoverRefused), ("mapped_buckets", 3, InvalidRequest),
                                ("mapped_buckets", -1, InvalidRequest)]:
        release = dict(run_id="r", handover_id=opened.handover_id, share_id=share, mapped_buckets=0)
        with pytest.raises(error, match=field):
            host.release(pb.ReleaseWeightHandlesRequest(**{**release, field: value}))
    closed = host.close_handover(pb.CloseWeightHandoverRequest(run_id="r", handover_id=opened.handover_id))
    assert closed.unreleased == 1  # the share handed out but never released is dropped by the close


def _handles(host) -> pb.WeightHandles:
    opened = host.open(pb.OpenWeightHandoverRequest(run_id="r", replicas=1))
    return host.handles(pb.GetWeightHandlesRequest(run_id="r", policy_version=3, handover_id=opened.handover_id,
                                                   node_id=ipc.node_id()))


def _check(handles: pb.WeightHandles, **overrides) -> list[ipc.BucketLayout]:
    asked = dict(run_id="r", policy_version=3, handover_id=handles.handover_id, current_version=0,
                 node=ipc.node_id())
    return ipc.check_handles(handles, **{**asked, **overrides})


def test_a_replica_refuses_handles_that_are_not_the_ones_it_asked_for(host):
    handles = _handles(host)
    assert len(_check(handles)) == 2
    for overrides, reason in [({"current_version": 3}, "stale"), ({"current_version": 5}, "stale"),
                              ({"handover_id": "0" * 32}, "handover_id"), ({"run_id": "x"}, "run_id"),
                              ({"policy_version": 4}, "policy_version"), ({"node": "elsewhere"}, "node_id")]:
        with pytest.raises(ipc.HandleRefused, match=reason):
            _check(handles, **overrides)

    def tampered(edit) -> pb.WeightHandles:
        copy = pb.WeightHandles()
        copy.CopyFrom(handles)
        edit(copy)
        return copy

    for edit, reason in [
        (lambda h: setattr(h.buckets[0], "shm_name", b"/../etc/passwd"), "shm_name"),
        (lambda h: setattr(h.buckets[0], "shm_manager", b"/run/docker.sock"), "shm_manager"),
        (lambda h: setattr(h.buckets[0], "handle", b"x" * 64), "handle"),
        (lambda h: setattr(h, "backend", "pickle"), "backend"),
        (lambda h: setattr(h.buckets[0].tensors[0], "offset", 7), "offset"),
        (lambda h: setattr(h.buckets[1].tensors[0], "offset", 1 << 30), "offset"),
        (lambda h: setattr(h.buckets[1].tensors[1], "name", "embed"), "repeated"),
        (lambda h: setattr(h, "tensors", 2), "tensors/bytes"),
    ]:
        with pytest.raises(ipc.HandleRefused, match=reason):
            _check(tampered(edit))


def test_a_cuda_handover_for_a_device_this_process_does_not_see_is_refused():
    with pytest.raises(ipc.HandleRefused, match="does not see"):
        ipc.local_index("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(ipc.HandleRefused, match="does not see"):
        ipc.local_index("")
    assert ipc.node_details(None)["device_uuids"] == ",".join(ipc.visible_device_uuids())
