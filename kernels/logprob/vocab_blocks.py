"""Vocab blocks of the fused linear head, and the fixed-order sum of their d(hidden) contributions.

The fused head (linear_head.py) multiplies hidden states by the lm_head one
vocab block at a time. A block is a run of whole log-prob tiles (tiling.py) at
a fixed place in *global* vocab coordinates: block b covers global columns
[b * width, (b + 1) * width), whatever the TP degree. Each block goes through
the log-prob backend as if it were one TP shard of a TP-`real_blocks` run, so
the per-tile partials, their global order and hence every output bit are those
the kernel's own TP path guarantees; a real TP rank simply holds a contiguous
run of blocks. Every GEMM has the shape [chunk_tokens, H] x [H, width] whatever
the call, so the GEMM library picks one kernel (and one reduction order) for
all of them.

d(hidden) sums one contribution per block. Floating-point addition is not
associative, so the sum is a pairwise tree over a leaf count fixed by the vocab
alone (`tree_leaves`), missing leaves counting as +0.0. A rank whose blocks
form an aligned power-of-two run computes a complete subtree; ranks then
finish the same tree over the gathered subtree sums. That is why d(hidden) is
bitwise the same at TP 1, 2, 4, 8.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

import torch

from kernels.logprob.contract import LogprobContractError
from kernels.logprob.tiling import ShardLayout

DEFAULT_VOCAB_BLOCK_TILES = 8
"""Tiles per block: Qwen3's 151936 columns (64 tiles of 2374) make 8 blocks of 18992 columns,
one per rank at TP 8."""


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class VocabBlockPlan:
    """Where this rank's shard of the lm_head sits among the global vocab blocks."""

    shard: ShardLayout
    """This rank's vocab shard (TP 1: the whole vocab)."""
    tiles_per_block: int
    """Log-prob tiles per block; part of the definition (another value groups the GEMMs differently)."""

    @cached_property
    def width(self) -> int:
        """Columns per block (the last real block may hold fewer real columns)."""
        return self.tiles_per_block * self.shard.tile_width

    @cached_property
    def real_blocks(self) -> int:
        """Blocks holding at least one real column: ceil(V / width). A function of V alone."""
        return -(-self.shard.global_vocab_size // self.width)

    @cached_property
    def tree_leaves(self) -> int:
        """Leaves of the d(hidden) tree: real_blocks rounded up to a power of two."""
        return next_pow2(self.real_blocks)

    @cached_property
    def first_block(self) -> int:
        return self.shard.vocab_start // self.width

    @cached_property
    def local_blocks(self) -> int:
        """Blocks of this shard (TP 1: the last may be cut by the end of the weight)."""
        return -(-self.shard.local_vocab_size // self.width)

    @cached_property
    def subtree_aligned(self) -> bool:
        """True when this rank's blocks form one complete subtree of the d(hidden) tree."""
        n = self.local_blocks
        return n == next_pow2(n) and n <= self.tree_leaves

    def is_real(self, block: int) -> bool:
        return block < self.real_blocks

    def local_rows(self, block: int) -> tuple[int, int]:
        """[start, end) rows of this rank's weight shard that block `block` covers."""
        lo = block * self.width - self.shard.vocab_start
        return lo, min(lo + self.width, self.shard.local_vocab_size)

    def block_layout(self, block: int) -> ShardLayout:
        """The block as the log-prob backend sees it: shard `block` of a TP-`real_blocks` vocab."""
        return ShardLayout(
            global_vocab_size=self.shard.global_vocab_size, vocab_start=block * self.width,
            local_vocab_size=self.width, tp_rank=block, tp_world_size=self.real_blocks,
        )


def plan_vocab_blocks(shard: ShardLayout, tiles_per_block: int) -> VocabBlockPlan:
    """The block plan of a shard, or LogprobContractError when its bounds cut a block."""
    if isinstance(tiles_per_block, bool) or not isinstance(tiles_per_block, int) or tiles_per_block < 1:
        raise LogprobContractError(f"vocab_block_tiles: must be an int >= 1, got {tiles_per_block!r}")
    plan = VocabBlockPlan(shard, tiles_per_block)
    if shard.tp_world_size > 1 and shard.local_vocab_size % plan.width:
        tiles = shard.local_vocab_size / shard.tile_width
        raise LogprobContractError(
            f"vocab_block_tiles: blocks of {tiles_per_block} tiles ({plan.width} columns) must not straddle TP "
            f"shards, but each shard holds {shard.local_vocab_size} columns ({tiles:g} tiles of "
            f"{shard.tile_width}); pick a vocab_block_tiles that divides the tiles per shard"
        )
    return plan


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b with None as +0.0: x + None is x + 0.0, exactly what adding a zero tensor gives."""
    if a is None and b is None:
        return None
    if b is None:
        return a + 0.0
    if a is None:
        return b + 0.0
    return a + b


def pairwise_tree_sum(leaves: Iterable[torch.Tensor | None], count: int) -> torch.Tensor | None:
    """Sum of `count` leaves (None = +0.0) as a pairwise tree over next_pow2(count) leaves.

    Consumes the iterable one leaf at a time and holds at most log2(count) + 1
    partial sums, so the caller can produce leaves lazily (one GEMM each). The
    grouping depends only on the leaf count, and leaves past `count` (the power
    of two's padding) are +0.0.
    """
    total = next_pow2(count)
    stack: list[tuple[int, torch.Tensor | None]] = []  # (level, sum of 2**level consecutive leaves)
    seen = 0
    for leaf in leaves:
        if seen == count:
            raise ValueError(f"pairwise_tree_sum: more than the {count} leaves announced")
        seen += 1
        node: tuple[int, torch.Tensor | None] = (0, leaf)
        while stack and stack[-1][0] == node[0]:
            level, left = stack.pop()
            node = (level + 1, _add(left, node[1]))
        stack.append(node)
    if seen != count:
        raise ValueError(f"pairwise_tree_sum: {count} leaves announced, {seen} given")
    for _ in range(total - count):  # padding leaves, in the same place as in any other split of the tree
        node = (0, None)
        while stack and stack[-1][0] == node[0]:
            level, left = stack.pop()
            node = (level + 1, _add(left, node[1]))
        stack.append(node)
    if len(stack) != 1:
        raise AssertionError(f"pairwise tree over {total} leaves left {len(stack)} nodes")
    return stack[0][1]
