"""Expert parallelism: a mixture-of-experts layer's experts spread over the ranks of a process group.

    out = expert_parallel_forward(hidden, experts, weights, gate_up_local, down_local, act, group)
    # hidden [T, H] and experts, weights [T, k] (route()) are this rank's own tokens; gate_up_local
    # [E/P, 2I, H] and down_local [E/P, H, I] are the weights of the experts this rank owns.

With E experts over a group of P ranks (P divides E), rank r owns experts [r E/P, (r+1) E/P)
(`expert_slice`): contiguous blocks, so a rank's experts are one slice of each [E, N, K] weight and the
grouped GEMM runs on the slice unchanged. Per call, on every rank of the group (a collective: every rank
calls it once per MoE layer forward, with or without tokens):

1. the (token, top-k rank) pairs are sorted by expert (`sort_by_expert`, stable). Blocks are contiguous, so
   expert order is destination-rank order, then expert, then token;
2. the rows per expert are exchanged first (an all-to-all of E/P integers per pair of ranks, no split
   sizes needed), then the rows themselves (`all_to_all_single` with per-rank split sizes);
3. the owner re-sorts what it received by its local expert (stable: within an expert, source rank then the
   source's order) and runs the same SwiGLU MLP of grouped GEMMs as one process (`expert_mlp`, the same
   `impl`) on its slice;
4. a second all-to-all (the first one's split sizes swapped) returns every row to its source, which puts
   the rows back in (token, rank) order and combines them in top-k rank order in float32
   (`combine_in_rank_order`), the code `experts_forward` runs.

Why a token's output is bitwise the one-process output (docs/moe.md, "Expert parallelism"): the
exchanges move rows and add nothing; an expert's output row is a function of that row and the expert's
weight alone (the grouped GEMM's batch invariance: `reference` on CPU, `triton` on GPU), whichever rows
from which ranks share the call; and the combination is the same elementwise sequence on the token's
own values, at its source. So it holds at any P and whatever tokens the other ranks hold.

Autograd: the functional `all_to_all_single` (torch.distributed._functional_collectives) is
differentiable, its adjoint being the reverse exchange; so d(hidden) and d(weights) arrive at the token's
rank and d(gate_up_local), d(down_local) at the owner, summed over every row that reached it: expert
weight gradients stay local, with nothing to all-reduce across the expert-parallel group (replicas of the
same slice in a larger data-parallel group still reduce among themselves).

Host reads: one per call, of the 2 P split sizes. c10d's `all_to_all_single` takes split sizes as Python
ints and its output's row count is the sum of the incoming ones, so the counts must reach the host before
the rows move (on CUDA a sync per MoE layer). The counts' own exchange needs none. A CUDA graph (the
engine's captured decode step) would need split sizes on the device: torch's NVSHMEM all-to-all
(`torch.ops.symm_mem.all_to_all_vdev`, symmetric memory) takes them so, and is what such a path would use.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kernels.moe.experts import combine_in_rank_order, expert_mlp, sort_by_expert
from kernels.moe.grouped import GroupedImpl


class ExpertParallelInputError(ValueError):
    """Expert-parallel input that cannot be used (experts not divisible over the group, wrong shapes...);
    names the argument."""


def expert_slice(n_experts: int, group_size: int, rank: int) -> slice:
    """The experts rank `rank` of a group of `group_size` owns: [rank E/P, (rank+1) E/P)."""
    if group_size < 1 or n_experts % group_size:
        raise ExpertParallelInputError(f"group size: {group_size} ranks must divide the {n_experts} experts")
    if not 0 <= rank < group_size:
        raise ExpertParallelInputError(f"rank: {rank} is not in a group of {group_size}")
    per_rank = n_experts // group_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _check(hidden, experts, weights, gate_up_local, down_local) -> None:
    if hidden.dim() != 2 or experts.dim() != 2 or weights.shape != experts.shape or experts.shape[0] != hidden.shape[0]:
        raise ExpertParallelInputError(f"hidden, experts, weights: expected [T, H], [T, k], [T, k]; got "
                                       f"{tuple(hidden.shape)}, {tuple(experts.shape)}, {tuple(weights.shape)}")
    if experts.dtype != torch.int64:
        raise ExpertParallelInputError(f"experts: expected int64 expert ids, got {experts.dtype}")
    local, two_i, h = gate_up_local.shape if gate_up_local.dim() == 3 else (0, 0, 0)
    if (not local or two_i % 2 or h != hidden.shape[1]
            or tuple(down_local.shape) != (local, hidden.shape[1], two_i // 2)):
        raise ExpertParallelInputError(f"gate_up_local, down_local: expected [E/P, 2I, H={hidden.shape[1]}] and "
                                       f"[E/P, H, I]; got {tuple(gate_up_local.shape)} and {tuple(down_local.shape)}")


def _exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """rows[sum(send_splits[:j]) : ...] to rank j; what rank j sends here lands in its place in the result.
    Differentiable: the backward is the same exchange with the split sizes swapped."""
    return funcol.wait_tensor(funcol.all_to_all_single(rows.contiguous(), recv_splits, send_splits, group))


def expert_parallel_forward(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                            gate_up_local: torch.Tensor, down_local: torch.Tensor,
                            act: Callable[[torch.Tensor], torch.Tensor], group: dist.ProcessGroup | None = None, *,
                            impl: GroupedImpl = "auto") -> torch.Tensor:
    """[T, H] in hidden's dtype: `experts_forward` of this rank's tokens, the experts spread over `group`
    (None: the default group). A collective: every rank of the group calls it, with or without tokens."""
    _check(hidden, experts, weights, gate_up_local, down_local)
    group = group if group is not None else dist.group.WORLD
    ranks, local = dist.get_world_size(group), gate_up_local.shape[0]
    tokens, k = experts.shape
    order, counts = sort_by_expert(experts, ranks * local)  # expert order == destination rank order
    rows = hidden[order // k]
    # received[s, j]: rows source s sends for this rank's local expert j.
    received = _exchange(counts, [local] * ranks, [local] * ranks, group).view(ranks, local)
    # The one host read (see the module docstring): split sizes are Python ints in c10d's API.
    splits = torch.cat([counts.view(ranks, local).sum(1), received.sum(1)]).tolist()
    send_splits, recv_splits = splits[:ranks], splits[ranks:]
    arrived = _exchange(rows, recv_splits, send_splits, group)  # source-major: (source, expert, position)
    segment_expert = torch.arange(ranks * local, device=counts.device) % local
    row_expert = torch.repeat_interleave(segment_expert, received.reshape(-1), output_size=arrived.shape[0])
    by_expert = torch.argsort(row_expert, stable=True)  # expert-major; within one: source, then position
    out_local = expert_mlp(arrived[by_expert], gate_up_local, down_local, received.sum(0), act, impl=impl)
    returned = _exchange(out_local[torch.argsort(by_expert)], send_splits, recv_splits, group)
    out = returned[torch.argsort(order)].reshape(tokens, k, hidden.shape[1])  # (token, rank) order
    return combine_in_rank_order(out, weights, hidden.dtype)


class ShardedExperts(torch.nn.Module):
    """One rank's experts of a Hugging Face `*Experts` module (Qwen3-MoE, Qwen2-MoE), computed expert
    parallel over `group`. Same call as the module it replaces: (hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], so a SparseMoeBlock calls it unchanged."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn: Callable, n_experts: int,
                 group: dist.ProcessGroup, impl: GroupedImpl) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up_proj)
        """[E/P, 2I, H]: the owned experts' gate and up projections."""
        self.down_proj = torch.nn.Parameter(down_proj)
        """[E/P, H, I]: the owned experts' down projections."""
        self.act_fn = act_fn
        self.num_experts = n_experts
        """Experts of the whole layer (E), over every rank of the group."""
        self.group = group
        self.impl = impl
        self.owned = expert_slice(n_experts, dist.get_world_size(group), dist.get_rank(group))
        """The global ids of the experts this rank holds."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                                       self.down_proj, self.act_fn, self.group, impl=self.impl)

    def extra_repr(self) -> str:
        return f"experts {self.owned.start}..{self.owned.stop - 1} of {self.num_experts}, impl={self.impl}"


def shard_experts(module: torch.nn.Module, group: dist.ProcessGroup | None = None, *,
                  impl: GroupedImpl = "auto") -> ShardedExperts:
    """This rank's `ShardedExperts` of a Hugging Face experts module holding all E experts (a copy of the
    owned slice; the module itself is left as it was). `impl`: the grouped GEMM, as for `experts_forward`
    (`auto`: the batch-invariant one of the device, true_on_policy; `grouped_mm` as in fast mode)."""
    group = group if group is not None else dist.group.WORLD
    where = type(module).__name__
    for flag in ("has_bias", "is_transposed"):
        if getattr(module, flag, False):
            raise ExpertParallelInputError(f"{where}: {flag}=True experts are not covered (bias-free [E, N, K] "
                                           "expert weights only)")
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or gate_up.shape[1] % 2 or tuple(down.shape) != (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        raise ExpertParallelInputError(f"{where}: gate_up_proj and down_proj must be [E, 2I, H] and [E, H, I] "
                                       "tensors")
    n_experts = gate_up.shape[0]
    owned = expert_slice(n_experts, dist.get_world_size(group), dist.get_rank(group))
    return ShardedExperts(gate_up.detach()[owned].clone(), down.detach()[owned].clone(), module.act_fn, n_experts,
                          group, impl)


def shard_model_experts(model: torch.nn.Module, group: dist.ProcessGroup | None = None, *,
                        impl: GroupedImpl = "auto") -> list[str]:
    """Replace every MoE block's `experts` in `model` by this rank's `ShardedExperts`; the paths replaced.
    Routers, attention and everything else stay as they are (replicated). In true_on_policy, patch the
    model first (make_batch_invariant) and shard after: that patcher refuses classes it does not cover,
    this one included."""
    replaced = []
    for path, block in list(model.named_modules()):
        experts = getattr(block, "experts", None)
        if isinstance(experts, torch.nn.Module) and not isinstance(experts, ShardedExperts) \
                and type(experts).__name__.endswith("Experts"):
            block.experts = shard_experts(experts, group, impl=impl)
            replaced.append(f"{path}.experts" if path else "experts")
    if not replaced:
        raise ExpertParallelInputError(f"model: {type(model).__name__} has no mixture-of-experts `experts` module")
    return replaced
