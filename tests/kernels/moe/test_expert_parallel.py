"""Expert parallelism over real torch.distributed (gloo) process groups of 2 and 4 forked processes, against
one process with all the experts.

Forward: every token's output is bitwise `experts_forward`'s with the full weights (float32 and bfloat16),
whatever tokens each rank holds (the same tokens dealt out three ways, a rank with none), with routing
that leaves experts and whole ranks without rows; and a tiny Qwen3-MoE whose experts are sharded
(`shard_model_experts`) gives each rank's sequences the logits one process gives them.

Backward (float32): d(hidden), d(weights) of each rank's tokens and d(gate_up), d(down) of each rank's
expert slice equal one process's gradients over the ranks' tokens concatenated in rank order, within a
bound derived from the code (`_gradient_bounds`), not bitwise: the forward is bitwise, every exchange and
gather moves values exactly, and each expert's backward GEMMs see the same operands in the same row order
as one process (a stable sort within an expert keeps (source rank, source position), and the reference
batch is the ranks' tokens in rank order); but those GEMMs are torch._grouped_mm (per-group BLAS calls on
CPU), whose summation order torch does not promise for an operand at another address inside a
differently sized call, nor does torch promise one for a sum over H at another row count.

Processes are forked on one thread each, as in tests/kernels/logprob/test_logprob_distributed.py; each
rank writes its results to a file the test compares with the one-process run.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.moe import experts_forward, route
from kernels.moe.expert_parallel import (
    ExpertParallelInputError, ShardedExperts, expert_parallel_forward, expert_slice, shard_experts,
    shard_model_experts,
)
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise
from tests.support.forked_ranks import run_forked_ranks
from tests.support.rounding_bounds import gamma, unit_roundoff

E, K_TOP, H, INTER = 8, 2, 16, 8
TOKENS = 14


def _weights(dtype):
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) / 4).to(dtype)
    down = (torch.randn(E, H, INTER, generator=g) / 3).to(dtype)
    return gate_up, down


def _tokens(dtype, uneven: bool):
    """hidden [T, H], experts [T, k], weights [T, k] float32, upstream gradient [T, H]. `uneven`: every
    token routes among experts {0, 1, 5} only: experts 2, 3, 4, 6, 7 get no rows; at P=4 ranks 1 and 3
    (experts 2-3, 6-7) receive none."""
    g = torch.Generator().manual_seed(11 + uneven)
    hidden = torch.randn(TOKENS, H, generator=g).to(dtype)
    logits = torch.randn(TOKENS, E, generator=g)
    if uneven:
        logits[:, [0, 1, 5]] += 20.0
    weights, experts = route(logits, K_TOP, norm_topk_prob=True)
    return hidden, experts, weights, torch.randn(TOKENS, H, generator=g)


def _deals(world: int) -> dict[str, list[torch.Tensor]]:
    """Ways of dealing the TOKENS token indices out to the ranks (each rank's list, in its order)."""
    everything = torch.arange(TOKENS)
    cuts = [TOKENS * r // world for r in range(world + 1)]
    return {
        "contiguous": [everything[cuts[r]:cuts[r + 1]] for r in range(world)],
        "interleaved_reversed": [everything.flip(0)[r::world] for r in range(world)],
        "last_rank_empty": [everything[r::world - 1] if r < world - 1 else everything[:0] for r in range(world)],
    }


def _act(x):
    return F.silu(x)


def _one_process(dtype, uneven: bool, take: torch.Tensor | None = None, grads: bool = False):
    """experts_forward on the tokens `take` (all, in order, by default): output, and with `grads` the
    gradients of (output * upstream).sum() for hidden, weights, gate_up, down."""
    hidden, experts, weights, upstream = _tokens(dtype, uneven)
    gate_up, down = _weights(dtype)
    take = torch.arange(TOKENS) if take is None else take
    leaves = [t.clone().requires_grad_(grads) for t in (hidden[take], weights[take], gate_up, down)]
    out = experts_forward(leaves[0], experts[take], leaves[1], leaves[2], leaves[3], _act, impl="reference")
    if not grads:
        return out.detach(), None
    (out.float() * upstream[take]).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _gradient_bounds(uneven: bool, take: torch.Tensor) -> list[torch.Tensor]:
    """Elementwise bounds on |a - b| for two float32 evaluations of the backward of experts_forward on the
    tokens `take` whose forwards have the same bits, and whose elementwise ops on the same inputs therefore
    give the same bits; to first order in u (the neglected terms are products of two bounds).

    Where two evaluations may round differently, and how far apart they may land (Higham's gamma_n,
    tests/support/rounding_bounds.py), per (token, rank) pair row routed to expert e:
    - d(h) = dY W_down[e] (dY = w * upstream, the same bits): a length-H dot product, 2 gamma_H |dY||W|;
    - d(up) = d(h) s (s = SiLU(gate)): the difference in d(h), times |s|, plus one rounding of each: 2u;
    - d(gate) = (d(h) up) SiLU'(gate): the difference in d(h) times |up SiLU'|, plus the rounding of the
      product and of torch's SiLU backward (sigmoid: exp, add, divide; then 1 - s, times x, plus 1, and
      two products: at most 10 roundings, exp counted as two): 2 gamma_11;
    - d(rows) = d(gate_up) W_gate_up[e]: the differences carried through |W|, plus 2 gamma_2I;
    - d(hidden)[t] = the sum of its k rows (index_put accumulate): the rows' differences plus 2 gamma_(k-1);
    - d(down[e]) = dY_e^T h_e and d(gate_up[e]) = d(gate_up)_e^T x_e: over the M_e rows of the expert,
      2 gamma_M_e, plus for gate_up the differences in d(gate_up) carried through |x|;
    - d(weights)[t, r] = sum over H of upstream * out_r (the same bits): 2 gamma_H.
    Magnitudes come from a float64 evaluation of the same values."""
    u = unit_roundoff(torch.float32)
    hidden, experts, weights, upstream = (t[take] for t in _tokens(torch.float32, uneven))
    hidden, weights, upstream = hidden.double(), weights.double(), upstream.double()
    gate_up, down = (t.double() for t in _weights(torch.float32))
    w = weights
    pairs = experts.reshape(-1)
    x = hidden.repeat_interleave(K_TOP, 0)                       # [T k, H]: (token, rank) order
    dy = (upstream[:, None, :] * w[:, :, None]).reshape(-1, H)   # [T k, H]
    wgu, wd = gate_up[pairs], down[pairs]                        # each pair's expert weights
    gu = torch.einsum("mk,mnk->mn", x, wgu)
    gate, up = gu.chunk(2, -1)
    sig = torch.sigmoid(gate)
    s, ds = gate * sig, sig * (1 + gate * (1 - sig))
    h = s * up
    dh = torch.einsum("mn,mnk->mk", dy, wd)
    err_dh = 2 * gamma(H) * torch.einsum("mn,mnk->mk", dy.abs(), wd.abs())
    d_up, d_gate = dh * s, dh * up * ds
    err_up = err_dh * s.abs() + 2 * u * d_up.abs()
    err_gate = err_dh * (up * ds).abs() + 2 * gamma(11) * d_gate.abs()
    dgu, err_dgu = torch.cat([d_gate, d_up], -1), torch.cat([err_gate, err_up], -1)
    drows = torch.einsum("mn,mnk->mk", dgu, wgu)
    err_rows = torch.einsum("mn,mnk->mk", err_dgu, wgu.abs()) + 2 * gamma(2 * INTER) * torch.einsum(
        "mn,mnk->mk", dgu.abs(), wgu.abs())
    per_token = drows.abs().reshape(-1, K_TOP, H).sum(1)
    err_hidden = err_rows.reshape(-1, K_TOP, H).sum(1) + (2 * gamma(K_TOP - 1) * per_token if K_TOP > 1 else 0)
    err_down, err_gate_up = torch.zeros(E, H, INTER, dtype=torch.float64), torch.zeros(E, 2 * INTER, H,
                                                                                       dtype=torch.float64)
    for e in range(E):
        rows = pairs == e
        m = int(rows.sum())
        if m:
            err_down[e] = 2 * gamma(m) * dy[rows].abs().T @ h[rows].abs()
            err_gate_up[e] = err_dgu[rows].T @ x[rows].abs() + 2 * gamma(m) * dgu[rows].abs().T @ x[rows].abs()
    out = torch.einsum("mk,mnk->mn", h, wd).reshape(-1, K_TOP, H)
    err_weights = 2 * gamma(H) * (upstream[:, None, :] * out).abs().sum(-1)
    return [err_hidden, err_weights, err_gate_up, err_down]


SEQUENCE_LENGTHS = ((5, 2), (8,), (3, 6, 1), (4,))
"""Rank r's sequences for the model check: different counts and lengths on every rank."""


def _tiny_moe_sequences(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(3, 30, (n,), generator=g) for n in SEQUENCE_LENGTHS[rank]]


def _tiny_moe():
    from kernels.batch_invariant.hf import make_batch_invariant
    from recipes.tiny_moe import TinyMoeConfig, build_tiny_moe

    return make_batch_invariant(build_tiny_moe(TinyMoeConfig(), seed=0))


def _logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sequence's logits from one packed forward of `seqs` (batch-invariant attention)."""
    from kernels.attention import REGISTRY, register_hf_attention
    from kernels.attention.hf import packed_forward_kwargs

    model.set_attn_implementation(register_hf_attention())
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        out = model(input_ids=ids[None], use_cache=False, **packed_forward_kwargs(positions, cu, max(map(len, seqs))))
    return list(out.logits[0].split([len(s) for s in seqs]))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # see test_logprob_distributed.py: forked children must not open thread teams
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        owned = expert_slice(E, world, rank)
        for dtype in (torch.float32, torch.bfloat16):
            gate_up, down = _weights(dtype)
            for uneven in (False, True):
                hidden, experts, weights, upstream = _tokens(dtype, uneven)
                for deal, takes in _deals(world).items():
                    take = takes[rank]
                    grads = dtype == torch.float32 and deal != "interleaved_reversed"
                    leaves = [t.clone().requires_grad_(grads) for t in
                              (hidden[take], weights[take], gate_up[owned], down[owned])]
                    out = expert_parallel_forward(leaves[0], experts[take], leaves[1], leaves[2], leaves[3], _act,
                                                  impl="reference")
                    entry = {"out": out.detach()}
                    if grads:
                        (out.float() * upstream[take]).sum().backward()
                        entry["grads"] = [t.grad for t in leaves]
                    results[(str(dtype), uneven, deal)] = entry
        model = _tiny_moe()
        results["replaced"] = shard_model_experts(model, impl="reference")
        sharded = model.model.layers[0].mlp.experts
        results["owned"] = ((sharded.owned.start, sharded.owned.stop), tuple(sharded.gate_up_proj.shape),
                            tuple(sharded.down_proj.shape))
        results["model"] = _logits(model, _tiny_moe_sequences(rank))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _largest(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_group_matches_one_process(world, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: CPU reductions split work by it
    try:
        want = {(str(dtype), uneven): _one_process(dtype, uneven)[0]
                for dtype in (torch.float32, torch.bfloat16) for uneven in (False, True)}
        reference_model = _tiny_moe()
        want_model = [_logits(reference_model, [s]) for r in range(world) for s in _tiny_moe_sequences(r)]
        deals = _deals(world)
        want_grads = {}
        for uneven in (False, True):
            for deal in ("contiguous", "last_rank_empty"):
                order = torch.cat(deals[deal])  # the ranks' tokens in rank order: the same rows per expert
                want_grads[(uneven, deal)] = (order, _one_process(torch.float32, uneven, order, grads=True)[1],
                                              _gradient_bounds(uneven, order))
    finally:
        torch.set_num_threads(threads)
    run_forked_ranks(_worker, world, tmp_path)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    for (dtype, uneven), full in want.items():
        for deal, takes in deals.items():
            for rank in range(world):
                assert_bitwise(got[rank][(dtype, uneven, deal)]["out"], full[takes[rank]],
                               f"P={world} {dtype} uneven={uneven} {deal}: rank {rank}'s tokens")
    for (uneven, deal), (order, grads, bounds) in want_grads.items():
        sizes = [len(t) for t in deals[deal]]
        for rank in range(world):
            where = f"P={world} uneven={uneven} {deal} rank {rank}"
            d_hidden, d_weights, d_gate_up, d_down = got[rank][(str(torch.float32), uneven, deal)]["grads"]
            rows = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
            owned = expert_slice(E, world, rank)
            for name, g, want_g, bound in (("d(hidden)", d_hidden, grads[0][rows], bounds[0][rows]),
                                           ("d(weights)", d_weights, grads[1][rows], bounds[1][rows]),
                                           ("d(gate_up)", d_gate_up, grads[2][owned], bounds[2][owned]),
                                           ("d(down)", d_down, grads[3][owned], bounds[3][owned])):
                assert g.shape == want_g.shape, (where, name)
                excess = (g.double() - want_g.double()).abs() - bound
                assert _largest(excess) <= 0, f"{where} {name}: beyond the bound by {_largest(excess)}"
                # The bound is far below what a misrouted row or a lost contribution costs.
                assert _largest(bound) <= 1e-4 * max(1.0, _largest(want_g.abs()))
            # Experts no token reached (uneven routing) get exact zeros on their owner.
            if uneven:
                unreached = [e - owned.start for e in range(owned.start, owned.stop) if e not in (0, 1, 5)]
                assert not d_down[unreached].any() and not d_gate_up[unreached].any(), where
    local = E // world
    for rank in range(world):
        assert got[rank]["replaced"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert got[rank]["owned"] == ((rank * local, (rank + 1) * local), (local, 2 * 32, 64), (local, 64, 32))
    model_logits = [logits for r in range(world) for logits in got[r]["model"]]
    assert len(model_logits) == len(want_model)
    for i, (g, w) in enumerate(zip(model_logits, want_model)):
        assert_bitwise(g, w[0], f"P={world}: tiny Qwen3-MoE sequence {i}'s logits with sharded experts")


def test_expert_slices_are_contiguous_blocks_and_refuse_what_does_not_divide():
    assert [expert_slice(8, 4, r) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert expert_slice(128, 8, 7) == slice(112, 128)
    with pytest.raises(ExpertParallelInputError, match="must divide the 6 experts"):
        expert_slice(6, 4, 0)
    with pytest.raises(ExpertParallelInputError, match="rank: 4"):
        expert_slice(8, 4, 4)


def test_bad_inputs_are_refused_before_any_collective():
    gate_up, down = _weights(torch.float32)
    hidden, experts, weights, _ = _tokens(torch.float32, False)
    with pytest.raises(ExpertParallelInputError, match="gate_up_local, down_local"):
        expert_parallel_forward(hidden, experts, weights, gate_up[:2], down[:3], _act)
    with pytest.raises(ExpertParallelInputError, match="hidden, experts, weights"):
        expert_parallel_forward(hidden, experts, weights[:, :1], gate_up[:2], down[:2], _act)
    with pytest.raises(ExpertParallelInputError, match="int64"):
        expert_parallel_forward(hidden, experts.int(), weights, gate_up[:2], down[:2], _act)

    class BiasedExperts(torch.nn.Module):
        has_bias = True

    with pytest.raises(ExpertParallelInputError, match="has_bias=True"):
        shard_experts(BiasedExperts())
    with pytest.raises(ExpertParallelInputError, match=r"\[E, 2I, H\] and \[E, H, I\]"):
        shard_experts(torch.nn.Module())
    assert ShardedExperts.forward.__code__.co_varnames[1:4] == ("hidden_states", "top_k_index", "top_k_weights")
