"""The public entry point and the autograd Function that every backend runs under.

One Function orchestrates forward (local partials -> all-gather over the TP
group -> merge in global slot order) and backward (elementwise gradient of the
local shard). Backends supply only those three pieces, so the orchestration --
where TP determinism lives -- is written once.
"""
from __future__ import annotations

from typing import Any

import torch

from kernels.logprob.contract import (
    DeterminismScope,
    LogprobContract,
    LogprobContractError,
    MaskMode,
    OutputSpec,
    platform_of,
)
from kernels.logprob.registry import registry_generation, select, verify_group_agreement
from kernels.logprob.tiling import ShardLayout


def _pack(m, s, w, tgt) -> torch.Tensor:
    return torch.cat([m, s] + ([w] if w is not None else []) + [tgt.unsqueeze(1)], dim=1).contiguous()


def layout_gathered(packed: list[torch.Tensor], slots: int, with_entropy: bool):
    """Per-rank packed partials (rank order) -> global [T, world*slots] partials and the target logit.

    Rank-major concatenation is global slot order because shards are contiguous
    and ascending. The target logit is -inf on every rank but its owner, so the
    max over ranks is exact.
    """
    S = slots
    gm = torch.cat([o[:, :S] for o in packed], dim=1)
    gs = torch.cat([o[:, S : 2 * S] for o in packed], dim=1)
    gw = torch.cat([o[:, 2 * S : 3 * S] for o in packed], dim=1) if with_entropy else None
    gt = torch.stack([o[:, -1] for o in packed], dim=1).amax(dim=1)
    return gm, gs, gw, gt


def _gather_partials(m, s, w, tgt, group):
    """All-gather this rank's partials over the TP group (the only collective of the forward)."""
    import torch.distributed as dist

    packed = _pack(m, s, w, tgt)
    out = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, packed, group=group)
    return layout_gathered(out, m.shape[1], w is not None)


def _forward(logits, targets, active, backend, layout, temperature, group, with_entropy):
    """(logp, lse, ent|None): the whole forward, with or without autograd around it."""
    if layout.tp_world_size == 1 and hasattr(backend, "local_forward"):
        # TP 1: the backend runs partials + merge its own cheapest way (bitwise equal to the path below).
        return backend.local_forward(logits, targets, layout, temperature, with_entropy, active)
    m, s, w, tgt = backend.partials(logits, targets, layout, temperature, with_entropy)
    if group is not None and layout.tp_world_size > 1:
        m, s, w, tgt = _gather_partials(m, s, w, tgt, group)
    return backend.merge(m, s, w, tgt, targets, layout.global_vocab_size, active)


class _TokenLogprobFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, active, backend, layout, temperature, group, with_entropy):
        logp, lse, ent = _forward(logits, targets, active, backend, layout, temperature, group, with_entropy)
        # Inactive rows have lse = 0 here; backward zeroes their gradient, so it needs no other value.
        mean_x = (lse - ent) if ent is not None else lse
        ctx.save_for_backward(logits, targets, lse, mean_x, active)
        ctx.meta = (backend, layout, temperature, with_entropy, active is not None)
        # Unused outputs get None, not materialized zeros, as gradient (no fill kernels per step).
        ctx.set_materialize_grads(False)
        return logp, lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_ent):
        backend, layout, temperature, with_entropy, has_active = ctx.meta
        logits, targets, lse, mean_x, active = ctx.saved_tensors
        if getattr(backend, "accepts_none_grads", False):
            # None stays None and g_logp keeps its row stride (0 after `.sum()`): no copies.
            g_logp = None if g_logp is None else g_logp.float()
            g_lse = None if g_lse is None else g_lse.float().contiguous()
            g_ent = (None if g_ent is None else g_ent.float().contiguous()) if with_entropy else None
        else:
            zeros = torch.zeros_like(lse)
            g_logp = zeros if g_logp is None else g_logp.float().contiguous()
            g_lse = zeros if g_lse is None else g_lse.float().contiguous()
            g_ent = (zeros if g_ent is None else g_ent.float().contiguous()) if with_entropy else None
        if g_logp is None and g_lse is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        grad = backend.backward(
            logits, targets, lse, mean_x if with_entropy else None, g_logp, g_lse, g_ent,
            active if has_active else None, layout, temperature,
        )
        return grad, None, None, None, None, None, None, None


def build_contract(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    global_vocab_size: int | None = None,
    tp_group: Any = None,
    masked: bool = False,
    with_entropy: bool = False,
    determinism: str = "cross_tp_bitwise",
) -> LogprobContract:
    """The contract a call with these arguments is dispatched against (also used by diagnostics)."""
    rank, world = 0, 1
    if tp_group is not None:
        import torch.distributed as dist

        rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, V_local], got shape {tuple(logits.shape)}")
    V_local = logits.shape[1]
    gvs = V_local * world if global_vocab_size is None else int(global_vocab_size)
    layout = ShardLayout(
        global_vocab_size=gvs, vocab_start=int(vocab_start), local_vocab_size=V_local, tp_rank=rank, tp_world_size=world
    )
    try:
        scope = DeterminismScope(determinism)
    except ValueError:
        raise LogprobContractError(
            f"determinism: {determinism!r} is not one of {[d.value for d in DeterminismScope]}"
        ) from None
    return LogprobContract(
        sharding=layout,
        input_dtype=logits.dtype,
        platform=platform_of(logits.device),
        temperature=float(temperature),
        mask_mode=MaskMode.EXPLICIT_ACTIVE_MASK if masked else MaskMode.NONE,
        determinism=scope,
        output=OutputSpec(entropy=with_entropy),
    )


def _validate_inputs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None, temperature: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [T, V_local], got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"logits: dtype must be bf16, fp16 or fp32, got {logits.dtype}")
    if targets.shape != (logits.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"targets: expected int64 [{logits.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device} but logits on {logits.device}")
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool or mask.device != logits.device):
        raise ValueError(f"mask: expected bool [{logits.shape[0]}] on {logits.device}, got {mask.dtype} {tuple(mask.shape)}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(f"temperature: must be > 0 and finite, got {temperature}")


# (call signature minus T) -> (contract, backend). Building the contract and selecting cost
# ~100 us of Python per call, as much as the kernels at T=2048; both are pure functions
# of this key (and of the registry, whose generation is part of it).
_PLANS: dict[tuple, tuple[LogprobContract, Any]] = {}


def _plan(logits, temperature, vocab_start, global_vocab_size, tp_group, backend, masked, with_entropy, determinism):
    group_key = None
    if tp_group is not None:
        import torch.distributed as dist

        group_key = (id(tp_group), dist.get_rank(tp_group), dist.get_world_size(tp_group))
    key = (
        logits.shape[1], logits.dtype, logits.device, float(temperature), int(vocab_start), global_vocab_size,
        group_key, backend, masked, with_entropy, determinism, registry_generation(),
    )
    hit = _PLANS.get(key)
    if hit is None:
        contract = build_contract(
            logits, temperature=temperature, vocab_start=vocab_start, global_vocab_size=global_vocab_size,
            tp_group=tp_group, masked=masked, with_entropy=with_entropy, determinism=determinism,
        )
        hit = (contract, select(backend, contract))
        if len(_PLANS) > 256:
            _PLANS.clear()
        _PLANS[key] = hit
    return hit


def _run(logits, targets, temperature, vocab_start, global_vocab_size, tp_group, backend, mask, with_entropy, determinism):
    _validate_inputs(logits, targets, mask, temperature)
    contract, impl = _plan(
        logits, temperature, vocab_start, global_vocab_size, tp_group, backend, mask is not None, with_entropy,
        determinism,
    )
    if contract.sharding.tp_world_size > 1:
        verify_group_agreement(tp_group, contract, impl.name)
    if logits.stride(1) != 1:
        logits = logits.contiguous()  # kernels assume unit column stride; rows may be strided
    if targets.stride(0) != 1:
        targets = targets.contiguous()
    args = (logits, targets, mask, impl, contract.sharding, float(temperature), tp_group, with_entropy)
    if logits.requires_grad and torch.is_grad_enabled():
        return _TokenLogprobFunction.apply(*args)
    # No graph to record (rollout scoring, the parity gate, eval): skip autograd's per-call cost.
    return _forward(*args)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    global_vocab_size: int | None = None,
    tp_group: Any = None,
    backend: str = "auto",
    mask: torch.Tensor | None = None,
    determinism: str = "cross_tp_bitwise",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log p(target) [T] and fp32 logsumexp [T] of log_softmax(logits / temperature).

    logits: [T, V_local] bf16/fp16/fp32, this rank's vocab shard starting at
    global column `vocab_start`. targets: [T] int64 global token ids.
    global_vocab_size: real vocab; columns at or beyond it are padding (-inf).
    Defaults to V_local x TP world size. tp_group: torch.distributed group of
    the vocab shards (None: one shard holds the whole vocab). backend:
    "reference", "triton", "native" or "auto" (refused when TP > 1, because
    ranks must not pick different backends). mask: optional bool [T] of active
    tokens; inactive tokens get logp = lse = 0 and zero gradient.
    determinism: "cross_tp_bitwise" (default; refused when shards cut tiles)
    or "fixed_topology".

    Outputs are identical on every TP rank and bitwise independent of batch
    composition and TP degree for a given backend and device. Differentiable
    w.r.t. logits (deterministic backward, no atomics). A target outside
    [0, global_vocab_size) yields NaN (no device sync to check it).
    """
    logp, lse, _ = _run(logits, targets, temperature, vocab_start, global_vocab_size, tp_group, backend, mask, False, determinism)
    return logp, lse


def token_logprobs_with_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_start: int = 0,
    global_vocab_size: int | None = None,
    tp_group: Any = None,
    backend: str = "auto",
    mask: torch.Tensor | None = None,
    determinism: str = "cross_tp_bitwise",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `token_logprobs`, plus the fp32 entropy [T] of softmax(logits / temperature) (differentiable)."""
    return _run(logits, targets, temperature, vocab_start, global_vocab_size, tp_group, backend, mask, True, determinism)


def emulate_tensor_parallel(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp: int,
    backend: str,
    temperature: float = 1.0,
    global_vocab_size: int | None = None,
    mask: torch.Tensor | None = None,
    determinism: str = "cross_tp_bitwise",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of a TP-`tp` run on one device: each shard of the full [T, V_padded] logits goes
    through the backend as that rank would, and the partials are laid out as the all-gather
    would deliver them. For tests and the benchmark's TP-invariance check (no autograd)."""
    _validate_inputs(logits, targets, mask, temperature)
    P = logits.shape[1]
    if P % tp:
        raise ValueError(f"padded vocab {P} is not divisible by tp={tp}")
    V_local = P // tp
    packed, impl, slots, layout = [], None, 0, None
    for r in range(tp):
        layout = ShardLayout(
            global_vocab_size=P if global_vocab_size is None else global_vocab_size,
            vocab_start=r * V_local, local_vocab_size=V_local, tp_rank=r, tp_world_size=tp,
        )
        contract = LogprobContract(
            sharding=layout, input_dtype=logits.dtype, platform=platform_of(logits.device),
            temperature=float(temperature), mask_mode=MaskMode.EXPLICIT_ACTIVE_MASK if mask is not None else MaskMode.NONE,
            determinism=DeterminismScope(determinism),
        )
        impl = select(backend, contract)
        shard = logits[:, r * V_local : (r + 1) * V_local]
        m, s, w, tgt = impl.partials(shard, targets, layout, float(temperature), False)
        packed.append(_pack(m, s, w, tgt))
        slots = m.shape[1]
    m, s, w, tgt = layout_gathered(packed, slots, False)
    logp, lse, _ = impl.merge(m, s, w, tgt, targets, layout.global_vocab_size, mask)
    return logp, lse


def resolved_backend(
    logits: torch.Tensor,
    *,
    backend: str = "auto",
    temperature: float = 1.0,
    vocab_start: int = 0,
    global_vocab_size: int | None = None,
    tp_group: Any = None,
    masked: bool = False,
    with_entropy: bool = False,
    determinism: str = "cross_tp_bitwise",
) -> str:
    """Name of the backend a call with these arguments runs on (for diagnostics such as the step-1 gate)."""
    _, impl = _plan(logits, temperature, vocab_start, global_vocab_size, tp_group, backend, masked, with_entropy,
                    determinism)
    return impl.name
