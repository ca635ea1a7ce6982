"""Which sequences the decoder runs each iteration: admission, prefill chunks, page tables, preemption.

Pure bookkeeping (no torch): the decoder asks it for the next prefill chunk and the next decode batch and
reports sampled tokens back. Pages are the KV pool's (services.rollout.embedded.kv_cache); page 0 is scratch and is
never handed out.

- A sequence's state is its tokens (prompt, then sampled tokens) and `computed`, how many leading positions
  have K/V in its pages. After a token is sampled, computed == len(tokens) - 1: the next decode step feeds
  the last token at position computed.
- Admission: waiting units (a unit is one sequence, or the n samples of a prompt sharing its prefill) are
  admitted in order while rows and pages allow; a unit's prompt pages are allocated once, with one reference
  per member. Policy `continuous` admits whenever there is room; `static` admits only when no row runs, and
  keeps finished rows in the decode batch until the whole batch has finished (the behaviour of a static
  batch, kept as a baseline).
- Prefill: up to `chunk_tokens` tokens per iteration, across admitted units in admission order; a unit whose
  last token is in the chunk gets that position's logits, from which each member samples its next token.
- Decode: every sequence that has sampled and not finished; before each step each gets a page for the
  position it writes, copying a shared page first (copy on write) or taking a fresh one.
- Preemption: when no page is free, kept prefixes (below) are evicted first, oldest first; then the most
  recently admitted sequence (or unit still in prefill) gives back its pages and returns to the head of the
  queue with its tokens; readmitted, it is prefilled again from its tokens. Never an error: the pool holds
  at least one sequence of the longest length allowed.
- Kept prefixes (multi-turn episodes): a sequence submitted with a `key` keeps its pages when it finishes,
  in `KeptPrefixes` under that key, holding the K/V of all its tokens but the last sampled one (whose K/V
  no step wrote). The allocator and the kept prefixes outlive one scheduler (one decoder call), so the
  episode's next turn, submitted under the same key with a context that extends those tokens, is admitted
  onto the kept pages and prefills only the rest (its first page written copied first if it is shared).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from services.rollout.embedded.kv_cache import PAGE_TOKENS, SCRATCH_PAGE


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


class PageAllocator:
    """Pages 1..pages-1 with reference counts; the lowest free page is handed out first (deterministic)."""

    def __init__(self, pages: int) -> None:
        self.refs = [0] * pages
        self._free = list(range(pages - 1, SCRATCH_PAGE, -1))  # a stack: pop() gives the lowest

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self.refs[p] = 1
        return out

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"page allocator: page {p} released with no reference (a bug)")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
        self._free.sort(reverse=True)

    def grow(self, pages: int) -> None:
        """The pool now has `pages` pages (more than before); the new ones are free."""
        if pages < len(self.refs):
            raise ValueError(f"page allocator: cannot shrink from {len(self.refs)} to {pages} pages")
        self._free = list(range(pages - 1, len(self.refs) - 1, -1)) + self._free
        self.refs += [0] * (pages - len(self.refs))
        self._free.sort(reverse=True)

    @property
    def referenced(self) -> int:
        """Sum of the reference counts (0 once every holder gave its pages back)."""
        return sum(self.refs)


@dataclass
class KeptPrefix:
    tokens: list[int]
    """The tokens whose K/V the pages hold, positions 0..len-1."""
    pages: list[int]
    """pages_for(len(tokens)) pages, one reference each held by the entry."""


MISS_REASONS = ("evicted", "weights", "released", "not_a_prefix")
"""Why a keyed sequence found no prefix to reuse although its episode kept one: evicted under pool pressure,
the weights changed since it was computed, the pool was freed, or the new context does not extend it."""


class KeptPrefixes:
    """K/V pages that sequences keep between decoder calls, by key (an episode's sample id); the oldest entry
    is evicted first. An entry dropped for a reason other than its owner's request leaves that reason behind,
    counted as a miss when the key next asks for its prefix."""

    def __init__(self, alloc: PageAllocator) -> None:
        self.alloc = alloc
        self.entries: dict[str, KeptPrefix] = {}  # insertion order: oldest first
        self._gone: dict[str, str] = {}
        self.misses: Counter[str] = Counter()

    @property
    def pages_held(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    def keep(self, key: str, tokens: list[int], pages: list[int]) -> None:
        """Hold `pages` (the caller's references pass to the entry) as the K/V of `tokens` under `key`."""
        if len(pages) != pages_for(len(tokens)):
            raise ValueError(f"kept prefix {key!r}: {len(pages)} pages for {len(tokens)} tokens")
        self.drop(key)
        self.entries[key] = KeptPrefix(tokens, pages)

    def usable(self, key: str, tokens: list[int]) -> KeptPrefix | None:
        """The entry of `key` if `tokens` extend its tokens by at least one; an entry they do not extend is
        dropped. A missing entry whose drop left a reason counts that reason as a miss."""
        entry = self.entries.get(key)
        if entry is None:
            reason = self._gone.pop(key, None)
            if reason is not None:
                self.misses[reason] += 1
            return None
        n = len(entry.tokens)
        if n >= len(tokens) or tokens[:n] != entry.tokens:
            self.drop(key)
            self.misses["not_a_prefix"] += 1
            return None
        return entry

    def take(self, key: str) -> KeptPrefix:
        """Remove the entry of `key`; its page references pass to the caller."""
        return self.entries.pop(key)

    def drop(self, key: str, reason: str | None = None) -> None:
        """Release the entry of `key` (if any). `reason`: why, when it is not the owner's request."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.alloc.release(entry.pages)
            if reason is not None:
                self._gone[key] = reason
        elif reason is None:
            self._gone.pop(key, None)

    def drop_all(self, reason: str) -> None:
        for key in list(self.entries):
            self.drop(key, reason)

    def evict_oldest(self, protect: frozenset[str] | set[str] = frozenset()) -> bool:
        """Evict the oldest entry whose key is not in `protect`; False if there is none."""
        for key in self.entries:
            if key not in protect:
                self.drop(key, "evicted")
                return True
        return False


@dataclass(eq=False)
class DecodeSequence:
    """A sequence is an entity: compared by identity (membership tests stay O(1) per element)."""

    index: int
    """Position in the request (the order results are returned in)."""
    prompt_len: int
    tokens: list[int]
    max_tokens: int
    """prompt_len + max_new_tokens."""
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    finish_reason: str | None = None
    preemptions: int = 0
    key: str | None = None
    """Keeps its pages under this key when it finishes, and starts from the prefix kept under it."""
    in_prefill: bool = False
    """Admitted and its unit's prefill not complete: it decodes only after (a chunk may end one token short
    of the end, where `computed` alone would read as decoding)."""

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return (self.finish_reason is None and not self.in_prefill and self.computed == len(self.tokens) - 1
                and self.computed > 0)


@dataclass(eq=False)
class Unit:
    """Sequences admitted together whose known tokens are identical (the samples of one prompt): prefilled once."""

    members: list[DecodeSequence]

    @property
    def leader(self) -> DecodeSequence:
        return self.members[0]


@dataclass(frozen=True)
class PrefillPiece:
    unit: Unit
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.unit.leader.tokens)


class Scheduler:
    def __init__(self, *, kept: KeptPrefixes, max_rows: int, chunk_tokens: int, policy: str = "continuous") -> None:
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduler: {policy!r} is not 'continuous' or 'static'")
        self.kept, self.alloc = kept, kept.alloc
        self.max_rows, self.chunk_tokens, self.policy = max_rows, chunk_tokens, policy
        self.waiting: deque[Unit] = deque()
        self.prefilling: list[Unit] = []  # admitted, prefill not complete (in admission order)
        self.running: list[DecodeSequence] = []  # admitted, in admission order (prefilling members too)
        self.prefill_tokens = 0  # tokens run through prefill forwards (a unit's prompt counts once)
        self.reused_tokens = 0  # tokens admitted with kept K/V (not prefilled; a unit's counts once)
        self.preemptions = 0
        self.copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ queue --

    def submit(self, unit: Unit) -> None:
        self.waiting.append(unit)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _copy_first(self, kept: KeptPrefix | None) -> bool:
        """Whether the kept page a prefill writes into next is held by another too (then it is copied first)."""
        return kept is not None and bool(len(kept.tokens) % PAGE_TOKENS) and self.alloc.refs[kept.pages[-1]] > 1

    def _need(self, lead: DecodeSequence, kept: KeptPrefix | None) -> int:
        """Pages to allocate to admit `lead` onto `kept`."""
        have = len(kept.pages) if kept is not None else 0
        return pages_for(len(lead.tokens)) - have + self._copy_first(kept)

    def _room(self, pages: int, protect: set[str | None] | frozenset[str] = frozenset()) -> bool:
        """Whether `pages` pages are free, after evicting kept prefixes (not those of `protect`) as needed."""
        while self.alloc.free < pages:
            if not self.kept.evict_oldest(protect):
                return False
        return True

    def _rows_live(self) -> int:
        return len(self.running)

    def admit(self) -> None:
        if self.policy == "static" and self.running:
            return
        while self.waiting:
            unit = self.waiting[0]
            if self._rows_live() + len(unit.members) > self.max_rows:
                return
            lead = unit.leader
            kept = self.kept.usable(lead.key, lead.tokens) if lead.key is not None else None
            # Headroom of a page per member (its first write) unless nothing runs: then admit what fits.
            spare = len(unit.members) if self.running else 0
            if self._need(lead, kept) + spare > self.alloc.free:
                # Room from kept prefixes: first those no sequence of this call waits for; when nothing runs
                # (no page would come back otherwise), any but the leader's own.
                waiting = {s.key for u in self.waiting for s in u.members if s.key is not None}
                self._room(self._need(lead, kept) + spare, protect=waiting)
                if not self.running:
                    self._room(self._need(lead, kept), protect={lead.key})
                if self._need(lead, kept) + spare > self.alloc.free:
                    return
            have, reuse = (kept.pages, len(kept.tokens)) if kept is not None else ([], 0)
            cow = self._copy_first(kept)
            need = self._need(lead, kept)
            if kept is not None:
                self.kept.take(lead.key)
                self.reused_tokens += reuse
            for s in unit.members[1:]:  # they share the leader's pages: their own kept prefixes are not needed
                if s.key is not None:
                    self.kept.drop(s.key)
            pages = list(have)
            if cow:
                fresh = self.alloc.alloc(1)
                assert fresh is not None
                self.copies.append((pages[-1], fresh[0]))
                self.alloc.release([pages[-1]])
                pages[-1] = fresh[0]
            more = self.alloc.alloc(need - cow)
            assert more is not None
            pages += more
            self.alloc.share(pages * (len(unit.members) - 1))
            for s in unit.members:
                s.pages, s.computed, s.in_prefill = list(pages), reuse, True
            self.waiting.popleft()
            self.prefilling.append(unit)
            self.running.extend(unit.members)

    # ---------------------------------------------------------------- prefill --

    def prefill_chunk(self) -> list[PrefillPiece]:
        """The next chunk: consecutive token spans of admitted units, in admission order, at most chunk_tokens."""
        budget, out = self.chunk_tokens, []
        for unit in self.prefilling:
            if budget <= 0:
                break
            lead = unit.leader
            end = min(len(lead.tokens), lead.computed + budget)
            out.append(PrefillPiece(unit, lead.computed, end))
            budget -= end - lead.computed
        return out

    def prefilled(self, piece: PrefillPiece) -> None:
        """The piece's K/V is in the pool."""
        self.prefill_tokens += piece.end - piece.start
        for s in piece.unit.members:
            s.computed = piece.end
        if piece.completes:
            self.prefilling.remove(piece.unit)
            for s in piece.unit.members:
                s.in_prefill = False

    # ----------------------------------------------------------------- decode --

    def decode_batch(self) -> list[DecodeSequence]:
        """Rows of the next decode step, in admission order, each with a private page for the slot it writes.

        May preempt. Static policy: finished rows stay in the batch (fed a pad token) until all have finished.
        Linear in the rows: membership is re-read only after a preemption (rare)."""
        rows: list[DecodeSequence] = []
        seen, live = self.preemptions, None
        for s in list(self.running):
            if self.preemptions != seen:  # a preemption took rows out: recompute who still runs
                seen, live = self.preemptions, {id(r) for r in self.running}
            if live is not None and id(s) not in live:  # preempted while an earlier row took its page
                continue
            ok = s.decoding or (self.policy == "static" and s.finish_reason is not None)
            if ok and self._own_slot(s):
                rows.append(s)
        if live is None and self.preemptions == seen:
            return rows
        live = {id(r) for r in self.running}
        return [s for s in rows if id(s) in live]

    def _own_slot(self, s: DecodeSequence) -> bool:
        """Give `s` a private page for position s.computed; preempt later sequences (or s itself) if none is free."""
        i = s.computed // PAGE_TOKENS
        while True:
            if i < len(s.pages) and self.alloc.refs[s.pages[i]] == 1:
                return True
            fresh = self.alloc.alloc(1) if self._room(1) else None
            if fresh is not None:
                if i < len(s.pages):
                    self.copies.append((s.pages[i], fresh[0]))
                    self.alloc.release([s.pages[i]])
                    s.pages[i] = fresh[0]
                else:
                    s.pages.append(fresh[0])
                return True
            victim = self._victim()
            self._preempt(victim)
            if victim is s or s in victim.members:
                return False

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) page copies the pool must make before the next decode step (copy on write)."""
        out, self.copies = self.copies, []
        return out

    def _victim(self) -> Unit:
        last = self.running[-1]
        for unit in self.prefilling:
            if last in unit.members:
                return unit
        return Unit([last])

    def _preempt(self, unit: Unit) -> None:
        if unit in self.prefilling:
            self.prefilling.remove(unit)
        for s in unit.members:
            self.running.remove(s)
            self.alloc.release(s.pages)
            s.pages, s.computed, s.in_prefill = [], 0, False
            s.preemptions += 1
            self.preemptions += 1
        # Readmitted first, with the tokens it has (a finished row of a static batch is done, not requeued).
        again = [s for s in unit.members if s.finish_reason is None]
        if again:
            self.waiting.appendleft(Unit(again))

    # --------------------------------------------------------------- results --

    def sampled(self, s: DecodeSequence, token: int, logprob: float, stops: frozenset[int]) -> None:
        """A token sampled for `s` (from a prefill's last position or a decode step)."""
        if s.finish_reason is not None:  # a static batch's finished row: its tokens are discarded
            s.computed += 1
            return
        s.tokens.append(token)
        s.logprobs.append(logprob)
        s.computed = len(s.tokens) - 1
        if token in stops:
            s.finish_reason = "stop"
        elif len(s.tokens) >= s.max_tokens:
            s.finish_reason = "length"
        if s.finish_reason is None:
            return
        if self.policy == "continuous":
            self._finish(s)
        elif all(r.finish_reason for r in self.running):  # a static batch ends with its last row
            self._release_all_finished()

    def _finish(self, s: DecodeSequence) -> None:
        self.running.remove(s)
        if s.key is not None:
            # The last sampled token's K/V was never written (a static batch's pad steps wrote past it; the
            # next turn's prefill writes those slots again before anything reads them).
            known = len(s.tokens) - 1
            keep = pages_for(known)
            self.alloc.release(s.pages[keep:])
            self.kept.keep(s.key, s.tokens[:known], s.pages[:keep])
        else:
            self.alloc.release(s.pages)
        s.pages = []

    def close(self) -> None:
        """Give back the pages of every sequence still admitted (a paused or failed call); kept prefixes stay."""
        for s in self.running:
            self.alloc.release(s.pages)
            s.pages = []
        self.running, self.prefilling = [], []

    def _release_all_finished(self) -> None:
        for s in list(self.running):
            self._finish(s)
