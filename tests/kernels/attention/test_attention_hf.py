"""A Hugging Face Qwen3 runs packed through the registry: packed log-probs equal one-sequence-at-a-time
log-probs (bitwise where the CPU's matmuls allow it), and HF's packing traps raise instead of passing."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import (
    HF_ATTN_IMPLEMENTATION,
    REGISTRY,
    AttentionBackend,
    AttentionBackendError,
    AttentionContractError,
    Capability,
    PackedLayout,
    packed_forward_kwargs,
    register_hf_attention,
)

from tests.support.rounding_bounds import response_logprob_bounds

transformers = pytest.importorskip("transformers")
VOCAB = 256


def logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The project's one log-prob definition (kernels/logprob), reference backend."""
    from kernels.logprob import token_logprobs

    return token_logprobs(logits, targets, backend="reference")[0]


def tiny_qwen3(seed: int = 0) -> "transformers.Qwen3ForCausalLM":
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One CPU thread: with more, MKL may split a GEMM's reduction across threads depending on the
    shape and on how busy the machine is, and the packed and one-at-a-time products then round
    differently (a loaded CI run once saw logits 2.6e-5 apart). One thread makes the comparison
    depend on the kernels alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    """(packed model on the registry's attention, the same weights on HF's own sdpa)."""
    name = register_hf_attention()
    packed = tiny_qwen3()
    single = copy.deepcopy(packed)  # deep copy: the config object (which holds the attention choice) too
    packed.set_attn_implementation(name)
    single.set_attn_implementation("sdpa")
    assert packed.config._attn_implementation == HF_ATTN_IMPLEMENTATION
    assert single.config._attn_implementation == "sdpa"
    return packed, single


def _sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _matmul_row_invariant(model, starts_lengths, total) -> list[bool]:
    """Per sequence: do this CPU's GEMMs give a sequence's rows the same bits whether computed inside
    the packed [1, T, K] product or alone as [1, L, K]? (MKL takes other kernels for small M.)"""
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(1)
    ok = [True] * len(starts_lengths)
    for k, n in shapes:
        w, x = torch.randn(n, k, generator=g), torch.randn(1, total, k, generator=g)
        full = F.linear(x, w)
        for i, (s, length) in enumerate(starts_lengths):
            ok[i] &= torch.equal(full[:, s:s + length], F.linear(x[:, s:s + length].clone(), w))
    return ok


CASES = {
    "mixed_1_to_300": [1, 2, 7, 300, 33, 5, 120, 1, 64, 250],
    "many_short": [1 + (i * 7) % 9 for i in range(36)],
    "one_long": [700],
    "long_among_short": [3, 600, 1, 2, 9],
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_logprobs_equal_one_sequence_at_a_time(models, case):
    packed_model, single_model = models
    lengths = CASES[case]
    seqs = _sequences(lengths)
    lay = PackedLayout.from_lengths(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.cat(seqs)
    REGISTRY.reset_usage()
    with torch.no_grad(), REGISTRY.forced("reference"):
        logits = packed_model(input_ids=ids[None], **packed_forward_kwargs(positions, lay.cu_seqlens,
                                                                             lay.max_seqlen)).logits[0]
        singles = [single_model(input_ids=s[None]).logits[0] for s in seqs]
    assert REGISTRY.usage() == {"reference": 2}  # one call per decoder layer, all through the registry

    starts = lay.cu_seqlens[:-1].tolist()
    invariant = _matmul_row_invariant(packed_model, list(zip(starts, lengths)), ids.numel())
    bitwise = []
    for s, n, single, inv in zip(starts, lengths, singles, invariant):
        same = torch.equal(logits[s:s + n], single)
        # Where the probe found the GEMMs row-invariant, the logits are bitwise equal. (On more than one
        # thread MKL's split could differ between the probe and the model call under load; the module
        # runs on one thread, see one_thread.)
        assert same or not inv, f"length {n}: GEMMs row-invariant here, yet packed logits differ from single"
        bitwise.append(same and inv)
    # Next-token log-probs of every sequence's own tokens (a sequence's last row has no target).
    rows = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(starts, lengths)])
    if rows.numel():
        lp_packed = logprobs(logits[rows], ids[rows + 1])
        lp_single = logprobs(torch.cat([x[:-1] for x in singles]), ids[rows + 1])
        dlogp = (lp_packed - lp_single).abs().double()
        worst = dlogp.max().item()
        # Elsewhere the two paths differ by rounding only: within what float32 guarantees for this model
        # and these tokens (tests/support/rounding_bounds.py), whatever this CPU's GEMMs do. (Only the
        # tokens that differ need their bound: one backward pass each.)
        bound = response_logprob_bounds(single_model, [(x[:1].tolist(), x[1:].tolist()) for x in seqs],
                                        only=dlogp > 0)
        assert (dlogp <= bound).all(), f"max |logp packed - logp single| = {worst:.3g} over its bound"
        # Bitwise logits give bitwise log-probs (the log-prob kernel is batch-composition invariant).
        same_rows = torch.cat([torch.full((n - 1,), b) for n, b in zip(lengths, bitwise)])
        assert torch.equal(lp_packed[same_rows], lp_single[same_rows])
    else:
        worst = 0.0
    # Record what this machine gives (pytest -rA shows it): which lengths were bitwise.
    print(f"{case}: bitwise for {sum(bitwise)}/{len(bitwise)} sequences; non-bitwise lengths "
          f"{sorted({n for n, b in zip(lengths, bitwise) if not b})}; max |dlogp| {worst:.3g}")


def test_packed_gradients_match_one_sequence_at_a_time(models):
    packed_model, single_model = models
    lengths = [5, 40, 1, 17, 90]
    seqs = _sequences(lengths, seed=3)
    lay = PackedLayout.from_lengths(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.cat(seqs)
    packed_model.zero_grad()
    single_model.zero_grad()
    with REGISTRY.forced("reference"):
        logits = packed_model(input_ids=ids[None], **packed_forward_kwargs(positions, lay.cu_seqlens,
                                                                             lay.max_seqlen)).logits[0]
        rows = torch.cat([torch.arange(s, s + n - 1) for s, n in zip(lay.cu_seqlens[:-1].tolist(), lengths)])
        logprobs(logits[rows], ids[rows + 1]).sum().backward()
    for s in seqs:
        if s.numel() > 1:
            out = single_model(input_ids=s[None]).logits[0]
            logprobs(out[:-1], s[1:]).sum().backward()
    for (name, p), q in zip(packed_model.named_parameters(), single_model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_unpacked_rows_without_varlen_kwargs_are_one_sequence_each(models):
    packed_model, single_model = models
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = packed_model(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB)
        b = single_model(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB)
    # The same GEMMs; only the attention calls differ (a row at a time or batched): rounding only.
    targets = ids[:, 1:].reshape(-1)
    dlogp = (logprobs(a, targets) - logprobs(b, targets)).abs().double()
    bound = response_logprob_bounds(single_model, [(r[:1].tolist(), r[1:].tolist()) for r in ids], only=dlogp > 0)
    assert (dlogp <= bound).all(), f"max |dlogp| = {dlogp.max().item():.3g} over its bound"


# ---- HF's traps are closed --------------------------------------------------------------------


def _packed_inputs(lengths=(4, 6)):
    lay = PackedLayout.from_lengths(list(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(7))
    return ids, packed_forward_kwargs(positions, lay.cu_seqlens, lay.max_seqlen)


def test_a_2d_attention_mask_with_packed_input_raises(models):
    ids, kw = _packed_inputs()
    kw["attention_mask"] = torch.ones_like(ids)
    with pytest.raises(AttentionContractError, match="got a 2-D attention_mask"):
        models[0](input_ids=ids, **kw)


@pytest.mark.parametrize("drop", ["cu_seq_lens_k", "max_length_q", "max_length_k"])
def test_a_partial_set_of_varlen_kwargs_raises(models, drop):
    ids, kw = _packed_inputs()
    del kw[drop]
    with pytest.raises(AttentionContractError, match=rf"must carry all four.*missing \['{drop}'\]"):
        models[0](input_ids=ids, **kw)


def test_restarting_positions_without_varlen_kwargs_raise(models):
    ids, kw = _packed_inputs()
    with pytest.raises(AttentionContractError, match="position_ids disagree with cu_seqlens"):
        models[0](input_ids=ids, position_ids=kw["position_ids"])


def test_varlen_kwargs_with_positions_that_do_not_restart_raise(models):
    ids, kw = _packed_inputs()
    kw["position_ids"] = torch.arange(ids.shape[1])[None]
    with pytest.raises(AttentionContractError, match="position_ids disagree with cu_seqlens at token 4"):
        models[0](input_ids=ids, **kw)


def test_hf_builds_no_mask_for_the_registry_attention(models):
    """Pins what the registered mask function gives: no mask at all for a packed batch (HF would otherwise
    build a [T, T] block mask from the restarting position_ids for sdpa/eager), so nothing is materialised."""
    from transformers.masking_utils import create_causal_mask

    ids, kw = _packed_inputs()
    embeds = models[0].get_input_embeddings()(ids)
    # Positional: the 4th parameter is `cache` in transformers 5.24 and `past_key_values` in 5.17.
    mask = create_causal_mask(models[0].config, embeds, None, None, position_ids=kw["position_ids"])
    assert mask is None


def _blind(q, k, v, layout, scale, window, deterministic):
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)


def test_forcing_a_boundary_blind_backend_through_hf_raises_naming_it(models):
    REGISTRY.register(AttentionBackend(
        name="test_blind_hf", target=f"{__name__}:_blind", priority=1,
        capabilities={"cpu": Capability(honours_boundaries=False, dtypes=frozenset({torch.float32}),
                                        max_head_dim=512)}))
    try:
        ids, kw = _packed_inputs()
        with REGISTRY.forced("test_blind_hf"), pytest.raises(
                AttentionBackendError, match="'test_blind_hf' refused: it does not honour sequence boundaries"):
            models[0](input_ids=ids, **kw)
    finally:
        REGISTRY.unregister("test_blind_hf")
