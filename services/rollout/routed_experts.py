"""Each token's experts (mixture-of-experts models) in the rollout's wire form, from either engine.

A table is [tokens, layers, k]: row p holds the experts each layer sent token p through when the model read
it; the last token is never read and is padding. On the wire (Sample.routed_experts) it is uint8 with 255 as
padding when the model has fewer than 255 experts, int32 with -1 otherwise: one small integer per token,
layer and rank (docs/moe.md). The trainer checks every id again before anything trains.
"""
from __future__ import annotations

import base64
import binascii

import numpy as np
import torch

PAD = -1
"""Padding in the int64 working form."""
U8_PAD = 255
"""Padding in the uint8 wire form."""


def to_wire(table: torch.Tensor, n_experts: int) -> torch.Tensor:
    """An int64 table with PAD for padding -> the wire form (uint8 below 255 experts, int32 otherwise)."""
    if n_experts < U8_PAD:
        return torch.where(table < 0, U8_PAD, table).to(torch.uint8)
    return table.to(torch.int32)


def from_sglang(encoded: object, *, tokens: int, layers: int, top_k: int, n_experts: int,
                where: str) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [tokens - 1, layers, top_k]: every position it
    read, the whole input included) as a wire table of `tokens` rows. ValueError naming `where` for anything
    else: absent, not base64, the wrong size, or an id outside [0, n_experts)."""
    if not isinstance(encoded, str):
        raise ValueError(f"{where}: no routed experts (the server runs without --enable-return-routed-experts?)")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: routed experts are not base64") from None
    per_row = layers * top_k
    if len(raw) % 4 or len(raw) // 4 != (tokens - 1) * per_row:
        raise ValueError(f"{where}: {len(raw)} bytes of routed experts; {tokens - 1} read positions x {layers} "
                         f"layers x {top_k} experts of int32 are {(tokens - 1) * per_row * 4}")
    ids = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).astype(np.int64)).reshape(tokens - 1, layers, top_k)
    if ids.numel() and bool(((ids < 0) | (ids >= n_experts)).any()):
        bad = ids[(ids < 0) | (ids >= n_experts)][0]
        raise ValueError(f"{where}: expert id {int(bad)} outside [0, {n_experts})")
    table = torch.cat([ids, torch.full((1, layers, top_k), PAD, dtype=torch.int64)])
    return to_wire(table, n_experts)
