"""Contract and registry: refusals name every rejected candidate; nothing falls back silently."""
from __future__ import annotations

import pytest
import torch

from kernels.logprob import (
    BackendEntry,
    BackendUnavailable,
    Capability,
    DeterminismScope,
    LogprobBackendError,
    LogprobContract,
    LogprobContractError,
    MaskMode,
    OutputSpec,
    Platform,
    ShardLayout,
    select,
    token_logprobs,
)
from kernels.logprob import registry
from kernels.logprob.tiling import num_tiles, tile_width


def _contract(platform=Platform.CUDA, dtype=torch.bfloat16, tp=1, rank=0, **kw) -> LogprobContract:
    V_local = 151936 // tp
    layout = ShardLayout(151936, rank * V_local, V_local, rank, tp)
    return LogprobContract(sharding=layout, input_dtype=dtype, platform=platform, **kw)


class _Fake:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def fake_registry(monkeypatch):
    """A registry of fakes, so that what is refused does not depend on this machine's GPU or compilers."""
    reg: dict[str, BackendEntry] = {}
    monkeypatch.setattr(registry, "_REGISTRY", reg)
    monkeypatch.setitem(registry.AUTO_ORDER, Platform.CUDA, ("fast", "broken", "reference"))

    def add(name, loader=None, **cap):
        cap.setdefault("dtypes", frozenset({torch.bfloat16, torch.float32}))
        registry.register_backend(BackendEntry(name, {Platform.CUDA: Capability(**cap)}, loader or (lambda p: _Fake(name))))

    return add


def test_tiling_rule():
    assert (tile_width(151936), num_tiles(151936)) == (2374, 64)
    assert (tile_width(50257), num_tiles(50257)) == (786, 64)
    assert (tile_width(10), num_tiles(10)) == (1, 10)
    for tp in (1, 2, 4, 8):
        assert ShardLayout(151936, 0, 151936 // tp, 0, tp).tile_aligned
    assert not ShardLayout(151936, 0, 152576 // 8, 0, 8).tile_aligned  # Megatron's 128*tp padding


def test_auto_on_cpu_is_the_reference():
    assert select("auto", _contract(platform=Platform.CPU)).name == "reference"


def test_auto_is_refused_under_tp():
    with pytest.raises(LogprobBackendError, match="auto' is refused when TP > 1"):
        select("auto", _contract(tp=2))


def test_unknown_backend_lists_the_choices():
    with pytest.raises(LogprobBackendError, match="unknown logprob backend 'fastest'.*reference, triton, native"):
        select("fastest", _contract())


def test_native_has_no_cpu_build():
    with pytest.raises(LogprobBackendError, match="native: no cpu implementation"):
        token_logprobs(torch.randn(2, 8), torch.tensor([0, 1]), backend="native")


def test_explicit_request_checks_capability_before_loading(fake_registry):
    """A contract outside a backend's declared capability is refused before anything is built."""
    def never(platform):
        raise AssertionError("loaded")

    fake_registry("narrow", loader=never, entropy=False)  # dtypes default to bf16 + fp32
    with pytest.raises(LogprobBackendError, match=r"narrow: dtype float16 not supported \(has bfloat16, float32\)"):
        select("narrow", _contract(dtype=torch.float16))
    with pytest.raises(LogprobBackendError, match="narrow: entropy output not supported"):
        select("narrow", _contract(output=OutputSpec(entropy=True)))


def test_auto_lists_every_rejected_candidate(fake_registry):
    fake_registry("fast", mask_modes=frozenset({MaskMode.NONE}))

    def fail(platform):
        raise BackendUnavailable("extension build failed: nvcc exited 1")

    fake_registry("broken", loader=fail)
    fake_registry("reference", determinism_scopes=frozenset({DeterminismScope.FIXED_TOPOLOGY}))
    with pytest.raises(LogprobBackendError) as err:
        select("auto", _contract(mask_mode=MaskMode.EXPLICIT_ACTIVE_MASK))
    msg = str(err.value)
    assert "no backend serves" in msg
    assert "fast: mask mode explicit_active_mask not supported" in msg
    assert "broken: unavailable: extension build failed: nvcc exited 1" in msg
    assert "reference: determinism scope cross_tp_bitwise not supported" in msg


def test_auto_takes_the_first_capable_candidate_and_skips_unavailable(fake_registry):
    fake_registry("fast", dtypes=frozenset({torch.float32}))

    def fail(platform):
        raise BackendUnavailable("not built")

    fake_registry("broken", loader=fail)
    fake_registry("reference")
    assert select("auto", _contract()).name == "reference"
    assert select("auto", _contract(dtype=torch.float32)).name == "fast"


def test_explicit_unavailable_backend_raises_instead_of_substituting(fake_registry):
    calls = []

    def fail(platform):
        calls.append(platform)
        raise BackendUnavailable("triton is not importable")

    fake_registry("broken", loader=fail)
    fake_registry("reference")
    for _ in range(2):
        with pytest.raises(LogprobBackendError, match="(?s)backend .broken. cannot serve.*broken: unavailable: triton"):
            select("broken", _contract())
    assert calls == [Platform.CUDA]  # a failed load is remembered, not retried per call


def test_tp_backend_must_declare_tensor_parallel(fake_registry):
    fake_registry("fast", tensor_parallel=False)
    with pytest.raises(LogprobBackendError, match="fast: tensor-parallel vocab shards not supported"):
        select("fast", _contract(tp=4, rank=1))


def test_contract_validation():
    with pytest.raises(LogprobContractError, match="temperature"):
        _contract(temperature=0.0)
    with pytest.raises(LogprobContractError, match="cross_tp_bitwise needs shard bounds on tile bounds"):
        LogprobContract(ShardLayout(151936, 0, 152576 // 8, 0, 8), torch.bfloat16, Platform.CUDA)
    LogprobContract(ShardLayout(151936, 0, 152576 // 8, 0, 8), torch.bfloat16, Platform.CUDA,
                    determinism=DeterminismScope.FIXED_TOPOLOGY)
    with pytest.raises(ValueError, match="vocab_start"):
        ShardLayout(151936, 0, 151936 // 2, 1, 2)
    with pytest.raises(LogprobContractError, match="determinism"):
        token_logprobs(torch.randn(2, 8), torch.tensor([0, 1]), determinism="mostly")


def test_fingerprint_is_rank_independent_and_covers_the_definition():
    a = _contract(tp=4, rank=0)
    assert a.fingerprint() == _contract(tp=4, rank=3).fingerprint()
    differing = [
        _contract(tp=2),
        _contract(tp=4, temperature=0.7),
        _contract(tp=4, dtype=torch.float32),
        _contract(tp=4, mask_mode=MaskMode.EXPLICIT_ACTIVE_MASK),
        _contract(tp=4, determinism=DeterminismScope.FIXED_TOPOLOGY),
        _contract(tp=4, output=OutputSpec(entropy=True)),
        _contract(tp=4, platform=Platform.ROCM),
    ]
    assert len({c.fingerprint() for c in differing} | {a.fingerprint()}) == len(differing) + 1
