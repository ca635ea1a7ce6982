"""The bucket hasher's pinned ring (services/common/weights/bucket_digest.PinnedRing): a slot is reused only once
every hash of the piece it last held has finished, whichever bucket or digest that piece belonged to.

The CUDA copy path itself needs a GPU (tests/kernels/digest/test_sha256_blocks_gpu.py); this is its reuse rule,
the part that was wrong: slots were tracked per bucket, so a second bucket's first copy could overwrite a slot
whose hashes from the first bucket still waited in the pool, and the digest came out wrong on CUDA.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from services.common.weights.bucket_digest import PinnedRing


def test_slots_are_handed_out_round_robin():
    ring = PinnedRing(["a", "b", "c"])
    assert [ring.claim() for _ in range(5)] == [0, 1, 2, 0, 1]


def test_a_slot_is_not_reused_before_its_last_pieces_hashes_finish():
    ring = PinnedRing(["a", "b"])
    pending = Future()
    first = ring.claim()
    ring.read_by(first, [pending])  # bucket 1's piece: its hash has not run yet
    ring.read_by(ring.claim(), [])  # bucket 2's first piece takes the other slot
    claimed: list[int] = []
    waiter = threading.Thread(target=lambda: claimed.append(ring.claim()))  # bucket 2's second piece
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not claimed, "slot 0 was handed out while a hash of its piece was pending"
    pending.set_result(b"")
    waiter.join()
    assert claimed == [first]
