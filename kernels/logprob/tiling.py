"""The fixed global vocab tiling and how one TP shard maps onto it.

Why a tiling that ignores the TP degree: the log-sum-exp of a row is a sum of
~150k floats, and floating-point addition is not associative. If each TP rank
reduced "its half" and ranks merged halves, TP=2 and TP=4 would group the
additions differently and disagree in the last bits. Instead the global vocab
is cut into tiles fixed by the vocab size alone; every backend reduces each
tile in a fixed in-tile order to an fp32 (max, sumexp) partial, and partials
are merged in global tile order. A rank just computes the tiles it holds, so
the sequence of partials -- and thus every bit of the result -- is the same for
TP 1, 2, 4 and 8 whenever shard bounds fall on tile bounds.

Shards whose bounds cut through a tile are still computed correctly: the rank
emits a partial for its piece of the tile (a "slot") and the pieces are merged
in global order. That is deterministic for a fixed topology but no longer
bitwise equal across TP degrees; `ShardLayout.tile_aligned` says which case
applies and the contract refuses `cross_tp_bitwise` when it is false.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

# Qwen3: V=151936 -> 64 tiles of 2374 columns, and 64 = lcm of TP 1/2/4/8, so a
# vocab divisible by 64 has shard bounds on tile bounds at every such degree.
TILE_COUNT = 64


def tile_width(global_vocab_size: int) -> int:
    """Columns per tile: ceil(V / 64). The last tile may be shorter."""
    if global_vocab_size < 1:
        raise ValueError(f"global_vocab_size: must be >= 1, got {global_vocab_size}")
    return -(-global_vocab_size // TILE_COUNT)


def num_tiles(global_vocab_size: int) -> int:
    """Tiles that hold at least one real column (64 unless V < 64*w rounding leaves fewer)."""
    w = tile_width(global_vocab_size)
    return -(-global_vocab_size // w)


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's logits [T, V_local] sit in the global tiling.

    Slot j of this rank covers global columns [first_tile*w + j*w, +w) clipped
    to the shard and to the real vocab; columns outside either are -inf.
    """

    global_vocab_size: int
    """Real vocab size V: global columns >= V are padding and count as -inf."""
    vocab_start: int
    """Global index of this shard's column 0."""
    local_vocab_size: int
    """Columns in this shard (V_local); equal on every rank."""
    tp_rank: int = 0
    tp_world_size: int = 1

    def __post_init__(self) -> None:
        if self.local_vocab_size < 1:
            raise ValueError(f"local vocab size must be >= 1, got {self.local_vocab_size}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside world size {self.tp_world_size}")
        if self.vocab_start != self.tp_rank * self.local_vocab_size:
            raise ValueError(
                f"vocab_start: shard of rank {self.tp_rank} with {self.local_vocab_size} columns must start at "
                f"{self.tp_rank * self.local_vocab_size} (equal contiguous shards), got {self.vocab_start}"
            )
        if self.padded_vocab_size < self.global_vocab_size:
            raise ValueError(
                f"global_vocab_size {self.global_vocab_size} exceeds the {self.padded_vocab_size} columns held by "
                f"{self.tp_world_size} shard(s) of {self.local_vocab_size}"
            )

    @cached_property
    def padded_vocab_size(self) -> int:
        return self.local_vocab_size * self.tp_world_size

    @cached_property
    def tile_width(self) -> int:
        return tile_width(self.global_vocab_size)

    @cached_property
    def num_tiles(self) -> int:
        return num_tiles(self.global_vocab_size)

    def _slot_range(self, rank: int) -> tuple[int, int]:
        """[first_tile, end_tile) of tiles that rank `rank` touches with real columns."""
        w = self.tile_width
        lo = rank * self.local_vocab_size
        hi = min(lo + self.local_vocab_size, self.global_vocab_size)
        if lo >= hi:
            return (0, 0)
        return (lo // w, (hi - 1) // w + 1)

    @cached_property
    def first_tile(self) -> int:
        return self._slot_range(self.tp_rank)[0]

    @cached_property
    def num_slots(self) -> int:
        """Partials this rank emits (its tiles, pieces included)."""
        a, b = self._slot_range(self.tp_rank)
        return b - a

    @cached_property
    def slots_per_rank(self) -> int:
        """Gather width: every rank pads its partials to this many with the identity (-inf, 0)."""
        return max(max(b - a for a, b in (self._slot_range(r) for r in range(self.tp_world_size))), 1)

    @cached_property
    def slot_col_offset(self) -> int:
        """Local column of slot 0's first column (<= 0: a tile piece may start on the previous rank)."""
        return self.first_tile * self.tile_width - self.vocab_start

    @cached_property
    def tile_aligned(self) -> bool:
        """True when every shard bound inside the real vocab is a tile bound (cross-TP bitwise possible)."""
        w = self.tile_width
        return all(
            (r * self.local_vocab_size) % w == 0
            for r in range(1, self.tp_world_size)
            if r * self.local_vocab_size < self.global_vocab_size
        )
