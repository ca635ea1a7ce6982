"""Token log-probabilities: the single definition shared by trainer and rollout engine.

`token_logprobs(logits, targets, ...) -> (logp, lse)`: fp32 log_softmax(logits /
temperature) at the targets and the logsumexp, over a fixed global tiling of
the vocab (tiling.py), dispatched by contract (contract.py) to a registered
backend (registry.py): reference (pure torch), triton, native (CUDA/HIP).

`linear_token_logprobs(hidden, weight, targets, ...)`: the same outputs for
logits = hidden @ weight.T without materialising them (linear_head.py).
"""
from kernels.logprob.api import (
    build_contract,
    emulate_tensor_parallel,
    resolved_backend,
    token_logprobs,
    token_logprobs_with_entropy,
)
from kernels.logprob.contract import (
    DeterminismScope,
    LogprobContract,
    LogprobContractError,
    MaskMode,
    OutputSpec,
    Platform,
)
from kernels.logprob.linear_head import DEFAULT_CHUNK_TOKENS, linear_token_logprobs
from kernels.logprob.registry import (
    BackendEntry,
    BackendUnavailable,
    Capability,
    LogprobBackendError,
    register_backend,
    registered_backends,
    select,
)
from kernels.logprob.tiling import TILE_COUNT, ShardLayout, num_tiles, tile_width

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "TILE_COUNT",
    "BackendEntry",
    "BackendUnavailable",
    "Capability",
    "DeterminismScope",
    "LogprobBackendError",
    "LogprobContract",
    "LogprobContractError",
    "MaskMode",
    "OutputSpec",
    "Platform",
    "ShardLayout",
    "build_contract",
    "emulate_tensor_parallel",
    "linear_token_logprobs",
    "num_tiles",
    "register_backend",
    "registered_backends",
    "resolved_backend",
    "select",
    "tile_width",
    "token_logprobs",
    "token_logprobs_with_entropy",
]
