"""SHA-256 of many equal-sized blocks of a device buffer at once: one lane per block.

The weights digest (services/common/weights/digest.py) is the sha256 over every tensor's 4 MiB block
digests, each the sha256 of the block's 256 KiB leaves' sha256s. A sha256 is a chain of compressions that
cannot be split, but leaves are independent: each lane of a program hashes one whole leaf (its 64-byte
chunks in order, then the one padding chunk a message of a multiple of 64 bytes takes), so a GPU hashes a
policy's tens of thousands of leaves in about the time one leaf's 4,097 compressions take, where hashing
them on the host costs a copy of every byte to the host and every core's time
(services/common/weights/bucket_digest.py makes the block digests from them). The result is bit for bit
hashlib's (reference: `reference_sha256_blocks`); the tests compare them in Triton's interpreter on small
blocks (the block size is a compile-time constant).

Blocks must be whole multiples of 64 bytes and start at a multiple of 4 bytes; a tensor's last, shorter leaf
is the caller's to hash elsewhere (services/common/weights/bucket_digest.py hashes those on the host).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

ROUND_CONSTANTS = (
    0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
    0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
    0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
    0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
    0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
    0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
    0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
    0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
)
INITIAL_STATE = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
LANES = 32  # blocks per program: one warp


@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (32 - n))


@triton.jit
def _ssig0(x):
    return _rotr(x, 7) ^ _rotr(x, 18) ^ (x >> 3)


@triton.jit
def _ssig1(x):
    return _rotr(x, 17) ^ _rotr(x, 19) ^ (x >> 10)


@triton.jit
def _round(a, b, c, d, e, f, g, h, kw):
    t1 = h + (_rotr(e, 6) ^ _rotr(e, 11) ^ _rotr(e, 25)) + (g ^ (e & (f ^ g))) + kw
    t2 = (_rotr(a, 2) ^ _rotr(a, 13) ^ _rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))
    return t1 + t2, a, b, c, d + t1, e, f, g


@triton.jit
def _k(k_ptr, i: tl.constexpr):
    return tl.load(k_ptr + i).to(tl.uint32, bitcast=True)


@triton.jit
def _sixteen(a, b, c, d, e, f, g, h, k_ptr, base: tl.constexpr,
             w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 0) + w0)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 1) + w1)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 2) + w2)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 3) + w3)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 4) + w4)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 5) + w5)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 6) + w6)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 7) + w7)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 8) + w8)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 9) + w9)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 10) + w10)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 11) + w11)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 12) + w12)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 13) + w13)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 14) + w14)
    a, b, c, d, e, f, g, h = _round(a, b, c, d, e, f, g, h, _k(k_ptr, base + 15) + w15)
    return a, b, c, d, e, f, g, h


@triton.jit
def _schedule(w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    """The message schedule's next 16 words: W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16]."""
    n0 = _ssig1(w14) + w9 + _ssig0(w1) + w0
    n1 = _ssig1(w15) + w10 + _ssig0(w2) + w1
    n2 = _ssig1(n0) + w11 + _ssig0(w3) + w2
    n3 = _ssig1(n1) + w12 + _ssig0(w4) + w3
    n4 = _ssig1(n2) + w13 + _ssig0(w5) + w4
    n5 = _ssig1(n3) + w14 + _ssig0(w6) + w5
    n6 = _ssig1(n4) + w15 + _ssig0(w7) + w6
    n7 = _ssig1(n5) + n0 + _ssig0(w8) + w7
    n8 = _ssig1(n6) + n1 + _ssig0(w9) + w8
    n9 = _ssig1(n7) + n2 + _ssig0(w10) + w9
    n10 = _ssig1(n8) + n3 + _ssig0(w11) + w10
    n11 = _ssig1(n9) + n4 + _ssig0(w12) + w11
    n12 = _ssig1(n10) + n5 + _ssig0(w13) + w12
    n13 = _ssig1(n11) + n6 + _ssig0(w14) + w13
    n14 = _ssig1(n12) + n7 + _ssig0(w15) + w14
    n15 = _ssig1(n13) + n8 + _ssig0(n0) + w15
    return n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15


@triton.jit
def _compress(h0, h1, h2, h3, h4, h5, h6, h7, k_ptr,
              w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
    a, b, c, d, e, f, g, h = _sixteen(h0, h1, h2, h3, h4, h5, h6, h7, k_ptr, 0,
                                      w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _schedule(
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    a, b, c, d, e, f, g, h = _sixteen(a, b, c, d, e, f, g, h, k_ptr, 16,
                                      w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _schedule(
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    a, b, c, d, e, f, g, h = _sixteen(a, b, c, d, e, f, g, h, k_ptr, 32,
                                      w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _schedule(
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    a, b, c, d, e, f, g, h = _sixteen(a, b, c, d, e, f, g, h, k_ptr, 48,
                                      w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15)
    return h0 + a, h1 + b, h2 + c, h3 + d, h4 + e, h5 + f, h6 + g, h7 + h


@triton.jit
def _word(p, live):
    """The big-endian 32-bit word at `p` (a little-endian int32 load, bytes swapped)."""
    x = tl.load(p, mask=live, other=0).to(tl.uint32, bitcast=True)
    return (x << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | (x >> 24)


@triton.jit
def _chunk(p, m):
    """The 16 big-endian words of the 64-byte chunk at `p` (zeros where `m` is false)."""
    return (_word(p + 0, m), _word(p + 1, m), _word(p + 2, m), _word(p + 3, m), _word(p + 4, m), _word(p + 5, m),
            _word(p + 6, m), _word(p + 7, m), _word(p + 8, m), _word(p + 9, m), _word(p + 10, m), _word(p + 11, m),
            _word(p + 12, m), _word(p + 13, m), _word(p + 14, m), _word(p + 15, m))


@triton.jit
def _state(k_ptr, i: tl.constexpr, LANES_: tl.constexpr):
    return tl.zeros([LANES_], dtype=tl.uint32) + tl.load(k_ptr + 64 + i).to(tl.uint32, bitcast=True)


# The lane count differs from bucket to bucket: left unspecialized, one compile (at service start) serves all.
@triton.jit(do_not_specialize=["n_lanes"])
def sha256_blocks_kernel(words_ptr, starts_ptr, k_ptr, out_ptr, n_lanes,
                         CHUNKS: tl.constexpr, LENGTH_BITS: tl.constexpr, LANES_: tl.constexpr):
    """Lane i hashes the CHUNKS x 64 bytes at word offset starts[i] of words_ptr (int32) into out[i, 0:8]."""
    lane = tl.program_id(0) * LANES_ + tl.arange(0, LANES_)
    live = lane < n_lanes
    start = tl.load(starts_ptr + lane, mask=live, other=0)
    h0 = _state(k_ptr, 0, LANES_)
    h1 = _state(k_ptr, 1, LANES_)
    h2 = _state(k_ptr, 2, LANES_)
    h3 = _state(k_ptr, 3, LANES_)
    h4 = _state(k_ptr, 4, LANES_)
    h5 = _state(k_ptr, 5, LANES_)
    h6 = _state(k_ptr, 6, LANES_)
    h7 = _state(k_ptr, 7, LANES_)
    # A message of whole 64-byte chunks ends with one padding chunk (the 1 bit, zeros, the length in bits): the
    # loop's last turn compresses that chunk, so the compression is compiled once.
    one_bit = tl.full([LANES_], 0x80000000, dtype=tl.uint32)
    high = tl.full([LANES_], LENGTH_BITS >> 32, dtype=tl.uint32)
    low = tl.full([LANES_], LENGTH_BITS & 0xFFFFFFFF, dtype=tl.uint32)
    # Each turn loads the next chunk's words while it compresses the ones the turn before loaded: the load's
    # latency hides behind a compression rather than adding to the chain.
    w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = _chunk(words_ptr + start, live)
    for chunk in range(CHUNKS + 1):
        real = chunk < CHUNKS
        n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15 = _chunk(
            words_ptr + start + (chunk + 1) * 16, live & (chunk + 1 < CHUNKS))
        h0, h1, h2, h3, h4, h5, h6, h7 = _compress(
            h0, h1, h2, h3, h4, h5, h6, h7, k_ptr, tl.where(real, w0, one_bit), w1, w2, w3, w4, w5, w6, w7, w8, w9,
            w10, w11, w12, w13, tl.where(real, w14, high), tl.where(real, w15, low))
        w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15 = \
            n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15
    out = out_ptr + lane * 8
    tl.store(out + 0, h0.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 1, h1.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 2, h2.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 3, h3.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 4, h4.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 5, h5.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 6, h6.to(tl.int32, bitcast=True), mask=live)
    tl.store(out + 7, h7.to(tl.int32, bitcast=True), mask=live)


def _constants(device: torch.device) -> torch.Tensor:
    """The round constants then the initial state, as int32 bit patterns."""
    values = [v - (1 << 32) if v >= 1 << 31 else v for v in ROUND_CONSTANTS + INITIAL_STATE]
    return torch.tensor(values, dtype=torch.int32).to(device)


def launch_sha256_blocks(buffer: torch.Tensor, starts: Sequence[int], block_bytes: int) -> torch.Tensor:
    """Queue the hashing of the `block_bytes` at each byte offset in `starts` of `buffer` (flat uint8) on the
    current stream; the [len(starts), 8] int32 state words, to read with `digests_of` once the stream is done.
    Every start a multiple of 4 bytes, block_bytes a multiple of 64, every block inside the buffer."""
    if block_bytes <= 0 or block_bytes % 64:
        raise ValueError(f"block_bytes: a positive multiple of 64, got {block_bytes}")
    if any(s % 4 or s < 0 or s + block_bytes > buffer.numel() for s in starts):
        raise ValueError("starts: every block must start at a multiple of 4 bytes and lie inside the buffer")
    usable = buffer.numel() - buffer.numel() % 4
    words = buffer[:usable].view(torch.int32)
    out = torch.empty(len(starts), 8, dtype=torch.int32, device=buffer.device)
    if not starts:
        return out
    word_starts = torch.tensor([s // 4 for s in starts], dtype=torch.int64).to(buffer.device)
    grid = (triton.cdiv(len(starts), LANES),)
    sha256_blocks_kernel[grid](words, word_starts, _constants(buffer.device), out, len(starts),
                               CHUNKS=block_bytes // 64, LENGTH_BITS=block_bytes * 8, LANES_=LANES, num_warps=1)
    return out


def digests_of(state: torch.Tensor) -> list[bytes]:
    """The 32-byte digests of launch_sha256_blocks' output (copied to the host)."""
    host = state.cpu().numpy().view("<u4").astype(">u4")  # each state word big-endian, as sha256 writes it
    return [row.tobytes() for row in host]


def reference_sha256_blocks(buffer: torch.Tensor, starts: Sequence[int], block_bytes: int) -> list[bytes]:
    """hashlib's sha256 of the same blocks: what the kernel must equal bit for bit."""
    data = buffer.cpu().numpy().tobytes()
    return [hashlib.sha256(data[s:s + block_bytes]).digest() for s in starts]
