"""Shared inputs and checks of the batch-invariant op tests (CPU, interpreted Triton and GPU).

Run as a module it checks guarantees (1) and (2) of the pure-torch ops and prints the CPU
capability torch runs with; the CPU tests run it under ATEN_CPU_CAPABILITY=default.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_COUNTS = (1, 3, 17, 64, 200)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    same = got.contiguous().view(-1).view(bits)
    ref = want.contiguous().view(-1).view(bits)
    if not torch.equal(same, ref):
        diff = (same != ref).nonzero().flatten()
        i = int(diff[0])
        raise AssertionError(f"{what}: {diff.numel()} of {same.numel()} elements differ in bits; first at flat "
                             f"index {i}: {got.reshape(-1)[i].item()!r} vs {want.reshape(-1)[i].item()!r}")


def pack_lengths(lengths, device="cpu") -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(lengths)).cumsum(0)
    return cu.to(device)


def make_qkv(total: int, n_heads: int, n_kv: int, head_dim: int, dtype, seed: int, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(total, h, head_dim, generator=g, device=device).to(dtype)
                 for h in (n_heads, n_kv, n_kv))


def sdpa_packed(q, k, v, cu_seqlens, scale):
    """Plain torch causal attention per sequence: the accuracy oracle."""
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])[0].transpose(0, 1))
    return torch.cat(outs)


def decode_rows_of_sequences(q, k, v, lengths, cap: int, fill: float):
    """One decode row per packed token: its query, its sequence's keys [0, t] in a cache row, `fill` beyond.

    Returns (q [T, H, D], k_cache, v_cache [T, Hkv, cap, D], lengths int32 [T]) so that
    decode row i corresponds to packed row i.
    """
    total, n_kv, d = k.shape
    kc = torch.full((total, n_kv, cap, d), fill, dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, fill)
    lens = torch.empty(total, dtype=torch.int32)
    start = 0
    for length in lengths:
        for t in range(length):
            row = start + t
            kc[row, :, : t + 1] = k[start:row + 1].transpose(0, 1)
            vc[row, :, : t + 1] = v[start:row + 1].transpose(0, 1)
            lens[row] = t + 1
        start += length
    return q, kc, vc, lens.to(k.device)


def edge_positions(lengths, key_block: int) -> list[int]:
    """Packed rows of the positions where a decode row's path can change: each sequence's first two and last two
    positions and its middle, and both sides of every key-block edge it holds (a block's last key, the next
    one's first). A decode row of position t walks ceil((t + 1) / key_block) blocks with the last one masked at
    t + 1, so positions between these take a path some of them already take."""
    rows, start = [], 0
    for n in lengths:
        picked = {0, 1, n // 2, n - 2, n - 1}
        for edge in range(key_block, n, key_block):
            picked |= {edge - 1, edge}
        rows += [start + t for t in sorted(picked) if 0 <= t < n]
        start += n
    return rows


def checked_rows(lengths, key_block: int, every: bool, device) -> torch.Tensor:
    """The packed rows a decode test compares: all of them (`every`), or edge_positions' where each decode row's
    programs are paid for one by one (the Triton interpreter)."""
    return torch.tensor(list(range(sum(lengths)) if every else edge_positions(lengths, key_block)), device=device)


def decode_rows_at(rows, q, k, v, lengths, cap):
    """decode_rows_of_sequences (NaN beyond each row's keys) for the packed rows `rows` only."""
    return tuple(t[rows] for t in decode_rows_of_sequences(q, k, v, lengths, cap=cap, fill=float("nan")))


def check_rotary_row_invariance(device: str) -> None:
    """HF Qwen3's rotary embedding gives a position the same cos/sin bits in any batch, and applying it is elementwise.

    Its forward is a [.., 1] x [1, D/2] broadcast product, cat, cos/sin and a cast: no reduction,
    so a row's bits depend only on its position. Checked against one call over all positions,
    for batches of other shapes, orders and sizes, in fp32 and bf16.
    """
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    cfg = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rope_theta=1000000.0)
    rotary = Qwen3RotaryEmbedding(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    n_pos = 4096
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype, device=device)
        cos_all, sin_all = rotary(x, torch.arange(n_pos, device=device)[None])
        for shape in ((1, 1), (3, 17), (8, 200), (1, 4000)):
            pos = torch.randint(0, n_pos, shape, generator=g).to(device)
            cos, sin = rotary(x, pos)
            assert_bitwise(cos, cos_all[0][pos], f"cos {dtype} batch {shape}")
            assert_bitwise(sin, sin_all[0][pos], f"sin {dtype} batch {shape}")
        # Applying it: [B, H, T, D] rows rotated alone or in a batch give the same bits.
        q = torch.randn(4, 16, 64, 128, generator=g).to(device, dtype)
        k = torch.randn(4, 8, 64, 128, generator=g).to(device, dtype)
        pos = torch.randint(0, n_pos, (4, 64), generator=g).to(device)
        cos, sin = rotary(q, pos)
        q_all, k_all = apply_rotary_pos_emb(q, k, cos, sin)
        q_one, k_one = apply_rotary_pos_emb(q[2:3, :, 5:9], k[2:3, :, 5:9], cos[2:3, 5:9], sin[2:3, 5:9])
        assert_bitwise(q_one, q_all[2:3, :, 5:9], f"rotated q {dtype}")
        assert_bitwise(k_one, k_all[2:3, :, 5:9], f"rotated k {dtype}")


def check_reference_invariance() -> None:
    from kernels.batch_invariant import KEY_BLOCK, bi_linear, bi_rms_norm, decode_attention, packed_attention

    lengths = [1, KEY_BLOCK - 1, KEY_BLOCK + 1, 9]
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(200, 136, generator=g).to(dtype)
        w = (torch.randn(40, 136, generator=g) / 12).to(dtype)
        nw = torch.randn(136, generator=g).to(dtype)
        lin, norm = bi_linear(x, w), bi_rms_norm(x, nw, 1e-6)
        for m in ROW_COUNTS:
            idx = torch.randperm(200, generator=g)[:m]
            assert_bitwise(bi_linear(x[idx], w), lin[idx], f"linear {dtype} M={m}")
            assert_bitwise(bi_rms_norm(x[idx], nw, 1e-6), norm[idx], f"rms_norm {dtype} M={m}")
        q, k, v = make_qkv(sum(lengths), 4, 2, 16, dtype, seed=1)
        cu = pack_lengths(lengths)
        packed = packed_attention(q, k, v, cu, max(lengths), 0.25)
        one = packed_attention(q[1:1 + lengths[1]], k[1:1 + lengths[1]], v[1:1 + lengths[1]],
                               pack_lengths(lengths[1:2]), lengths[1], 0.25)
        assert_bitwise(one, packed[1:1 + lengths[1]], f"packed {dtype} one sequence vs pack")
        dq, kc, vc, lens = decode_rows_of_sequences(q, k, v, lengths, cap=2 * KEY_BLOCK, fill=float("nan"))
        assert_bitwise(decode_attention(dq, kc, vc, lens, 0.25), packed, f"decode vs packed {dtype}")


if __name__ == "__main__":
    print(f"capability={torch.backends.cpu.get_cpu_capability()}")
    check_reference_invariance()
    print("invariance ok")
