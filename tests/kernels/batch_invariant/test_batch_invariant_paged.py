"""Paged attention (kernels/batch_invariant/paged.py): a token's bits do not depend on where its keys live.

Keys of each sequence are scattered over pages of a NaN-filled pool in a shuffled order. Then, bit for bit and
per implementation (pure torch; Triton interpreted on CPU, compiled on a GPU):
- paged decode at every position (the Triton kernels in the interpreter: at each page edge, each sequence's ends
  and middle) == packed attention over the whole sequence == dense decode;
- paged prefill of a sequence split into chunks at any point == packed attention;
and the Triton kernels agree with the reference within a dtype tolerance.
"""
from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import (
    KEY_BLOCK,
    BatchInvariantInputError,
    decode_attention,
    packed_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from tests.kernels.batch_invariant.batch_invariant_support import (
    assert_bitwise, checked_rows, decode_rows_at, make_qkv, pack_lengths,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes

LENGTHS = [1, KEY_BLOCK - 1, KEY_BLOCK + 1, 2 * KEY_BLOCK + 2, 9]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def scatter_into_pool(k, v, lengths, seed=0):
    """(k_pool, v_pool [pages, Hkv, KB, D] NaN outside the sequences' slots, block_tables int32 [S, max_pages])."""
    n_kv, d = k.shape[1:]
    need = [-(-n // KEY_BLOCK) for n in lengths]
    pages = sum(need) + 3
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist()
    k_pool = torch.full((pages, n_kv, KEY_BLOCK, d), float("nan"), dtype=k.dtype, device=k.device)
    v_pool = torch.full_like(k_pool, float("nan"))
    tables = torch.zeros((len(lengths), max(need) + 1), dtype=torch.int32)
    start = 0
    for s, n in enumerate(lengths):
        for i in range(need[s]):
            page = order.pop()
            tables[s, i] = page
            lo, hi = start + i * KEY_BLOCK, start + min(n, (i + 1) * KEY_BLOCK)
            k_pool[page, :, : hi - lo] = k[lo:hi].transpose(0, 1)
            v_pool[page, :, : hi - lo] = v[lo:hi].transpose(0, 1)
        start += n
    return k_pool, v_pool, tables.to(k.device)


# Triton's interpreter pays per program: on CPU the Triton variant takes shorter sequences (still crossing a key
# block, so a page), one split of each and decodes the rows of edge_positions (both sides of the page edge, each
# sequence's ends and middle); a GPU runs the full set.
INTERPRETED_LENGTHS = [KEY_BLOCK + 1, 3]


CASES = [("reference", torch.float32), ("reference", torch.bfloat16), ("triton", torch.bfloat16)]
if DEVICE == "cuda":
    CASES.append(("triton", torch.float32))


@pytest.mark.parametrize(("impl", "dtype"), CASES)
def test_paged_decode_and_chunked_prefill_equal_packed_bitwise(impl, dtype):
    interpreted = impl == "triton" and DEVICE == "cpu"
    lengths = INTERPRETED_LENGTHS if interpreted else LENGTHS
    n_heads, n_kv = 4, 2
    q, k, v = make_qkv(sum(lengths), n_heads, n_kv, 16, dtype, seed=5, device=DEVICE)
    cu = pack_lengths(lengths, DEVICE)
    packed = packed_attention(q, k, v, cu, max(lengths), 0.3, impl=impl)
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths)

    # Decode: one row per token (per checked token, interpreted), its sequence's table, length = position + 1.
    rows = checked_rows(lengths, KEY_BLOCK, not interpreted, DEVICE)
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)[rows]
    lens = torch.cat([torch.arange(1, n + 1) for n in lengths]).to(DEVICE, torch.int32)[rows]
    decoded = paged_decode_attention(q[rows], k_pool, v_pool, tables[seq_of], lens, 0.3, impl=impl)
    assert not decoded.isnan().any()
    assert_bitwise(decoded, packed[rows], f"{impl} paged decode vs packed")
    dq, kc, vc, dl = decode_rows_at(rows, q, k, v, lengths, cap=3 * KEY_BLOCK)
    assert_bitwise(decoded, decode_attention(dq, kc, vc, dl, 0.3, impl=impl), f"{impl} paged vs dense decode")

    # Prefill in two chunks per sequence, split anywhere (inside a key block, on its edge, at 0).
    splits = (lambda n: n // 2, lambda n: min(n, KEY_BLOCK), lambda n: 0, lambda n: max(0, n - 1))
    for cut_of in splits[:1] if interpreted else splits:
        cuts = [cut_of(n) for n in lengths]
        out = torch.empty_like(q)
        starts_all = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
        for part in (0, 1):
            spans = [(c, n) if part else (0, c) for c, n in zip(cuts, lengths)]
            live = [s for s, (a, b) in enumerate(spans) if b > a]
            if not live:
                continue
            rows = torch.cat([torch.arange(starts_all[s] + spans[s][0], starts_all[s] + spans[s][1]) for s in live])
            sub_cu = pack_lengths([spans[s][1] - spans[s][0] for s in live], DEVICE)
            firsts = torch.tensor([spans[s][0] for s in live], dtype=torch.int32, device=DEVICE)
            out[rows.to(DEVICE)] = paged_prefill_attention(
                q[rows.to(DEVICE)], k_pool, v_pool, tables[live], sub_cu, firsts,
                max(spans[s][1] - spans[s][0] for s in live), 0.3, impl=impl)
        assert_bitwise(out, packed, f"{impl} chunked paged prefill at cuts {cuts} vs packed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_paged_agrees_with_the_reference(dtype):
    lengths = INTERPRETED_LENGTHS + [2 * KEY_BLOCK + 2]
    q, k, v = make_qkv(sum(lengths), 6, 2, 24, dtype, seed=8, device=DEVICE)  # group 3, head dim padded to 32
    k_pool, v_pool, tables = scatter_into_pool(k, v, lengths, seed=2)
    cu = pack_lengths(lengths, DEVICE)
    starts = torch.zeros(len(lengths), dtype=torch.int32, device=DEVICE)
    got, want = (paged_prefill_attention(q, k_pool, v_pool, tables, cu, starts, max(lengths), 0.2, impl=i)
                 for i in ("triton", "reference"))
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    ends = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    last = q[(cu[1:] - 1).long()]
    got, want = (paged_decode_attention(last, k_pool, v_pool, tables, ends, 0.2, impl=i)
                 for i in ("triton", "reference"))
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_bad_paged_arguments_are_refused_by_name():
    q, k, v = make_qkv(4, 4, 2, 16, torch.float32, seed=1)
    k_pool, v_pool, tables = scatter_into_pool(k, v, [4])
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(BatchInvariantInputError, match="KEY_BLOCK"):
        paged_decode_attention(q[:1], k_pool[:, :, :8], v_pool[:, :, :8], tables, lens, 0.3)
    with pytest.raises(BatchInvariantInputError, match="block_tables"):
        paged_decode_attention(q[:1], k_pool, v_pool, tables.long(), lens, 0.3)
    with pytest.raises(BatchInvariantInputError, match="outside"):
        paged_decode_attention(q[:1], k_pool, v_pool, tables + 100, lens, 0.3)
    with pytest.raises(BatchInvariantInputError, match="lengths"):
        paged_decode_attention(q[:1], k_pool, v_pool, tables, lens * 100, 0.3)
    with pytest.raises(BatchInvariantInputError, match="starts"):
        paged_prefill_attention(q, k_pool, v_pool, tables, pack_lengths([4]), torch.tensor([0]), 4, 0.3)
