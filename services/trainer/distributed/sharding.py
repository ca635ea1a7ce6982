"""FSDP2 for the trainer: fp32 master weights sharded over the ranks, compute in the run's dtype.

Every trainer process, one or many, holds its policy through
`torch.distributed.fsdp.fully_shard` — one FSDP unit per decoder layer, the
embeddings, final norm and lm_head in the root unit — so there is one code
path for one rank and for N:
- Master weights, gradients and AdamW state are float32 shards
  (1/N of each tensor per rank). With a 16-bit compute dtype the
  `MixedPrecisionPolicy` casts a layer's shards to that dtype before its
  all-gather (round to nearest even, `tensor.to(dtype)`), so forward and
  backward run on exactly the bf16 cast of the master weights — the same
  tensors the rollout receives. Gradients are reduce-scattered in float32 and
  summed (not averaged: the loss is already a sum over the step's tokens
  divided by their count).
- With compute dtype float32 and one rank nothing is cast and every
  collective is a copy: the update is bitwise the one a plain module gets.

A single trainer process forms a world of one in-process (a HashStore, no
port); a data-parallel group joins its ranks at rank 0's authenticated rendezvous
(services/trainer/distributed/worker_group.py, rank_rendezvous.py). Either way the default process group is
the trainer's: one trainer per process.
"""
from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

_SINGLE_PROCESS_MARK = "_lockstep_single_process_group"


@dataclass(frozen=True)
class ShardingPlan:
    """How the policy is wrapped: the run's choices that change memory and speed, not the math."""

    compute_dtype: torch.dtype
    """Dtype of forward and backward (the master weights stay float32)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    compile_layers: bool = False
    """torch.compile each decoder layer's forward (inside FSDP's hooks and the checkpoint wrapper)."""
    cpu_offload: bool = False
    """Keep master weights, gradients and optimizer state on the CPU (the optimizer steps there)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def ensure_single_process_group(device: torch.device) -> None:
    """A world of one for a trainer that is not part of a group (idempotent)."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"this process already belongs to a process group of {dist.get_world_size()} ranks")
        return
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=10), **kwargs)
    setattr(dist, _SINGLE_PROCESS_MARK, True)


def join_group(backend: str, *, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Join a multi-rank group at `store`, leaving a world of one this process formed earlier (one trainer
    per process)."""
    if dist.is_initialized() and getattr(dist, _SINGLE_PROCESS_MARK, False):
        dist.destroy_process_group()
    setattr(dist, _SINGLE_PROCESS_MARK, False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (`model.model.layers` in the Llama/Qwen family)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.layers; "
                         "the trainer shards one FSDP unit per decoder layer")
    return layers


def _checkpoint_forward(forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compiled(forward):
    """torch.compile with dynamic shapes that fails loudly instead of silently running eager when the
    recompile limit is reached."""
    import torch._dynamo

    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(forward, dynamic=True)


def shard_policy(root: torch.nn.Module, lm: torch.nn.Module, device: torch.device, plan: ShardingPlan) -> None:
    """Wrap `root` (which holds the HF model `lm`) in place: one FSDP unit per decoder layer, then the root.

    Parameters must be float32 (the masters). Single rank: no resharding after
    forward (nothing to free, and backward would only copy again).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    not_fp32 = sorted({str(p.dtype) for p in root.parameters() if p.dtype != torch.float32})
    if not_fp32:
        raise ValueError(f"master weights must be float32, got {not_fp32}")
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    compute = None if plan.compute_dtype == torch.float32 else plan.compute_dtype
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=world > 1)
    for layer in decoder_layers(lm):
        if plan.compile_layers:
            # The bound forward, so FSDP's pre/post-forward hooks stay eager around the compiled
            # graph; every layer shares one compiled code object (dynamo inlines nn.Module
            # parameters as inputs), and shapes are dynamic so each microbatch length does not
            # recompile.
            layer.forward = compiled(layer.forward)
        if plan.activation_checkpointing:
            # The instance's forward, so module names (and state-dict keys) stay those of Hugging Face.
            layer.forward = functools.partial(_checkpoint_forward, layer.forward)
        fully_shard(layer, **common)
    fully_shard(root, **common)
    for unit in [*decoder_layers(lm), root]:
        # A sum, not FSDP's default mean over ranks, and by SUM collectives alone (gloo has no
        # pre-multiplied sum); dividing by 1 is skipped, so nothing rescales the gradients.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def reshard(root: torch.nn.Module) -> None:
    """Register the sharded float32 masters on every FSDP module of `root` again (local, no collective).

    The root unit stays gathered after a forward, and a forward without
    backward (no_grad scoring) leaves every unit gathered: until resharded,
    the module's parameters are the compute-dtype copies, not the masters.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def gathered_between_microbatches(root: torch.nn.Module, passes: int) -> Iterator[Callable[[int], None]]:
    """Around a step's `passes` forward/backward passes: yields `starting(index)`, to call as pass `index` begins.

    On a world of one every unit keeps its compute-dtype weights gathered from the first pass's backward to
    the last's: the masters do not change between microbatches, so gathering them again for each one (a cast
    and copy of every weight) would give the same tensors. Its gradients are not reduced until the last
    pass: FSDP accumulates each pass's compute-dtype gradient into a float32 unsharded one (its reduce
    dtype), which on one rank is the shard itself, so the float32 sums are the ones per-pass reduction
    makes, in the same order, without the per-pass copy into a reduce buffer and the add into the shard.
    The update is bitwise the one per-pass gathering and reduction give (tests/trainer/
    test_mixed_precision.py), and peak memory is unchanged: a world of one already holds every unit
    gathered from its forward to its backward, and the float32 accumulator stands where the shard's
    gradient would. The last pass reshards and reduces as usual; leaving early (an exception) reshards and
    drops what was accumulated. With several ranks (where resharding frees memory) nothing changes."""
    from torch.distributed.fsdp import FSDPModule

    keep = passes > 1 and dist.get_world_size() == 1 and isinstance(root, FSDPModule)

    def starting(index: int) -> None:
        if keep:
            last = index == passes - 1
            root.set_reshard_after_backward(last)
            root.set_requires_gradient_sync(last)

    completed = False
    try:
        yield starting
        completed = True
    finally:
        if keep:
            root.set_reshard_after_backward(True)
            root.set_requires_gradient_sync(True)
            reshard(root)
            if not completed:
                _drop_accumulated_gradients(root)


def _drop_accumulated_gradients(root: torch.nn.Module) -> None:
    """Forget the gradients FSDP accumulated without reducing them (a step that failed between passes), so
    that the next step starts from none. FSDP2 has no public call for it: the accumulator lives on each
    parameter's FSDPParam (`unsharded_accumulated_grad`, and the compute-dtype `.grad` of its unsharded
    parameter before the first upcast); tests/trainer/test_mixed_precision.py fails if that moves."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            param.unsharded_accumulated_grad = None
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def full_tensor(t: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter. Collective: every rank must call it. `copy=False`:
    where one rank holds it whole, the parameter's own tensor (live: read it before the weights change)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1:
        # One rank holds the whole tensor: a copy of its local shard (a new tensor, as the gather returns),
        # without a collective per tensor (an all-gather of one rank still costs a launch and a wait).
        local = t.to_local()
        if local.shape == t.shape:
            return local.clone() if copy else local
    return t.full_tensor()


def named_master_tensors(lm: torch.nn.Module, *, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole float32 master tensor) in state-dict order, tied aliases once. Collective. `copy`: as
    full_tensor's."""
    seen: set[int] = set()
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield name, full_tensor(t.detach(), copy=copy)


def load_master_tensors(lm: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into the (possibly sharded) master parameters; names already checked."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    targets = lm.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in weights.items():
            t = targets[name]
            if isinstance(t, DTensor):
                local = distribute_tensor(value.to(t.dtype), t.device_mesh, t.placements).to_local()
                t.to_local().copy_(local)
            else:
                t.copy_(value)


def optimizer_state(lm: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as whole tensors keyed by parameter name (independent of world size). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(lm, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(lm: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of `optimizer_state`: every rank passes the whole state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(lm, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
