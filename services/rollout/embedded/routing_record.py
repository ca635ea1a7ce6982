"""Which experts each token went through, as the embedded decoder ran it (mixture-of-experts models only).

The routers keep their last call's experts (kernels/moe/hf_blocks.py RouterState). After every prefill
chunk and decode step the decoder hands this recorder the rows it ran; the recorder copies each layer's
experts into a per-sequence table [tokens, layers, k] at the positions those rows read. A decode step
stashes its experts into one persistent device buffer inside the step (`stash`), so a step captured as a
CUDA graph leaves them there on replay too. The token at position p is routed when the model reads it:
prompt tokens in prefill, each sampled token in the next decode step; the last sampled token is never
read and stays padding. A position recomputed (preemption, resume) is overwritten with the recompute's
routing; a sequence admitted onto kept K/V (a multi-turn episode's earlier turns) was not read in this
call there, so it reports no routing rather than a partial one.

On the wire (Sample.routed_experts) a table is services/rollout/routed_experts.py's form.
"""
from __future__ import annotations

import torch

from kernels.moe.hf_blocks import observe_routing
from services.rollout.routed_experts import PAD, to_wire


class RoutingRecorder:
    def __init__(self, model: torch.nn.Module, max_rows: int, device: torch.device) -> None:
        # true_on_policy: make_batch_invariant gave the routers their states; fast: HF's router math, recorded.
        self.states = observe_routing(model)
        self.active = bool(self.states)
        cfg = model.config
        self.n_experts = int(getattr(cfg, "num_experts", 0) or 0)
        self.shape = (len(self.states), int(getattr(cfg, "num_experts_per_tok", 0) or 0))
        self._step = (torch.full((max_rows, *self.shape), PAD, dtype=torch.int64, device=device)
                      if self.active else None)
        self._tables: dict[int, torch.Tensor] = {}

    def start(self, seqs) -> None:
        """A decode call begins: an empty (all padding) table per sequence."""
        self._tables = {s.index: torch.full((s.max_tokens, *self.shape), PAD, dtype=torch.int64)
                        for s in seqs} if self.active else {}

    def _now(self) -> torch.Tensor:
        return torch.stack([state.experts for state in self.states], dim=1)  # [rows, layers, k]

    def prefill(self, pieces, cu: torch.Tensor) -> None:
        """After a packed prefill forward over `pieces` (rows cu[i]:cu[i+1] are piece i's positions)."""
        if not self.active:
            return
        routed = self._now().cpu()
        for i, piece in enumerate(pieces):
            rows = routed[int(cu[i]):int(cu[i + 1])]
            for member in piece.unit.members:
                self._tables[member.index][piece.start:piece.end] = rows

    def stash(self, rows: int) -> None:
        """Inside a decode step (and its graph): this step's experts into the persistent buffer."""
        if self.active:
            self._step[:rows].copy_(self._now())

    def decode(self, seqs) -> None:
        """After a decode step over `seqs` (row j read the last token of seqs[j]), before they append the
        token they sampled."""
        if not self.active:
            return
        routed = self._step[:len(seqs)].cpu()
        for j, s in enumerate(seqs):
            self._tables[s.index][len(s.tokens) - 1] = routed[j]

    def table(self, seq) -> torch.Tensor | None:
        """The sequence's experts [tokens, layers, k] in wire form, None for a dense model or when a position
        the model read has no record (its K/V came from a kept prefix)."""
        if not self.active:
            return None
        t = self._tables[seq.index][:len(seq.tokens)]
        if bool((t[:-1] < 0).any()):
            return None
        return to_wire(t, self.n_experts)
