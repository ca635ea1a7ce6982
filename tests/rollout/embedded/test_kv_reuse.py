"""KV reuse across the turns of a multi-turn episode in the embedded engine.

An episode's next turn is a prefix-extension of its last context: the engine keeps the episode's K/V
pages after a turn and prefills only the new suffix (the last sampled token and the observation). In
true_on_policy that must give the bits of re-prefilling the whole context every turn, under every
schedule: chunked prefill, a pool so small that kept prefixes are evicted and running sequences
preempted. The scheduler's page bookkeeping is checked alone first (no model).
"""
from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from contract.environment import EndReason, EpisodeLimits, EpisodeProblem
from kernels.batch_invariant import KEY_BLOCK
from services.rollout.embedded.scheduler import KeptPrefixes, PageAllocator, Scheduler, DecodeSequence, Unit, pages_for
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.episodes.requests import EpisodeRequest
from services.rollout.episodes.runner import EpisodeSpec
from tests.rollout.decoder_support import sampling
from tests.rollout.hostile_environments import register_feedback

register_feedback()

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# ---------------------------------------------------------------- bookkeeping (no model) --


def _drive(sched: Scheduler, next_token) -> list[tuple[int, int]]:
    """Run the scheduler as the decoder does, `next_token(seq)` standing in for the model; the copies made."""
    copies = []
    while not sched.done:
        sched.admit()
        copies += sched.take_copies()
        pieces = sched.prefill_chunk()
        for piece in pieces:
            sched.prefilled(piece)
            if piece.completes:
                for s in list(piece.unit.members):
                    sched.sampled(s, next_token(s), -1.0, frozenset({0}))
        rows = sched.decode_batch()
        copies += sched.take_copies()
        for s in rows:
            sched.sampled(s, next_token(s), -1.0, frozenset({0}))
        assert pieces or rows or sched.done
    sched.close()
    return copies


def _seq(index: int, tokens: list[int], new: int, key: str | None) -> DecodeSequence:
    return DecodeSequence(index, len(tokens), list(tokens), len(tokens) + new, key=key)


def _scheduler(kept: KeptPrefixes, chunk: int = 1000) -> Scheduler:
    return Scheduler(kept=kept, max_rows=8, chunk_tokens=chunk)


def test_a_finished_keyed_sequence_keeps_all_but_its_last_token_and_the_next_turn_prefills_the_rest():
    kept = KeptPrefixes(PageAllocator(16))
    prompt = list(range(1, KEY_BLOCK + 11))  # 74 tokens: two pages
    first = _seq(0, prompt, 5, "g/0")
    sched = _scheduler(kept)
    sched.submit(Unit([first]))
    _drive(sched, lambda s: 7)
    entry = kept.entries["g/0"]
    assert entry.tokens == first.tokens[:-1] and len(entry.tokens) == 78
    assert len(entry.pages) == pages_for(78) == 2 and all(kept.alloc.refs[p] == 1 for p in entry.pages)
    assert kept.alloc.referenced == 2  # nothing but the kept prefix holds a page
    # The next turn: context = the turn's tokens + an observation of 9 tokens.
    second = _seq(0, first.tokens + [9] * 9, 4, "g/0")
    sched = _scheduler(kept, chunk=3)  # chunked: the suffix spans several prefill iterations
    sched.submit(Unit([second]))
    _drive(sched, lambda s: 8)
    assert sched.reused_tokens == 78 and sched.prefill_tokens == 1 + 9  # the last sampled token + observation
    assert kept.entries["g/0"].tokens == second.tokens[:-1]
    kept.drop("g/0")
    assert kept.alloc.referenced == 0 and kept.alloc.free == 15 and not kept.entries


def test_a_shared_kept_page_is_copied_before_a_prefill_writes_into_it():
    kept = KeptPrefixes(PageAllocator(16))
    prompt = [5] * 10
    a, b = _seq(0, prompt, 4, "g/0"), _seq(1, prompt, 4, "g/1")
    sched = _scheduler(kept)
    sched.submit(Unit([a, b]))  # one prefill, shared pages; both stop at their first token
    _drive(sched, lambda s: 0)
    assert kept.entries["g/0"].pages == kept.entries["g/1"].pages
    page = kept.entries["g/0"].pages[0]
    assert kept.alloc.refs[page] == 2
    sched = _scheduler(kept)
    sched.submit(Unit([_seq(0, a.tokens + [3], 2, "g/0")]))
    sched.submit(Unit([_seq(1, b.tokens + [4, 4], 2, "g/1")]))
    copies = _drive(sched, lambda s: 0)
    assert copies[0][0] == page  # the first admitted copies the shared page; the second then holds it alone
    assert sched.reused_tokens == 20 and sched.prefill_tokens == 2 + 3
    assert kept.entries["g/0"].pages != kept.entries["g/1"].pages
    kept.drop_all("released")
    assert kept.alloc.referenced == 0


def test_a_context_that_does_not_extend_the_kept_tokens_is_prefilled_whole_and_counted():
    kept = KeptPrefixes(PageAllocator(8))
    sched = _scheduler(kept)
    first = _seq(0, [1, 2, 3], 2, "k")
    sched.submit(Unit([first]))
    _drive(sched, lambda s: 6)
    sched = _scheduler(kept)
    sched.submit(Unit([_seq(0, [1, 2, 4, 6, 6], 2, "k")]))
    _drive(sched, lambda s: 0)
    assert sched.reused_tokens == 0 and sched.prefill_tokens == 5 and kept.misses == {"not_a_prefix": 1}
    kept.drop("k")
    assert kept.alloc.referenced == 0


def test_pool_pressure_evicts_kept_prefixes_oldest_first_and_still_preempts_running_sequences():
    kept = KeptPrefixes(PageAllocator(5))  # four pages
    sched = _scheduler(kept)
    for i in range(3):  # three one-page prefixes kept
        sched.submit(Unit([_seq(i, [i + 1] * 10, 1, f"e{i}")]))
    _drive(sched, lambda s: 0)
    assert list(kept.entries) == ["e0", "e1", "e2"] and kept.alloc.free == 1
    # A keyless sequence of 130 tokens needs three pages: e0 and e1 go (oldest first), e2 stays.
    sched = _scheduler(kept)
    sched.submit(Unit([_seq(9, [9] * 120, 10, None)]))
    _drive(sched, lambda s: 5)
    assert list(kept.entries) == ["e2"]
    # e0's next turn finds its prefix evicted: a miss, counted, and its context prefilled whole.
    sched = _scheduler(kept)
    sched.submit(Unit([_seq(0, [1] * 10 + [0, 3], 1, "e0")]))
    _drive(sched, lambda s: 0)
    assert kept.misses["evicted"] == 1 and sched.reused_tokens == 0 and sched.prefill_tokens == 12
    # Four sequences growing to two pages each in a four-page pool: kept prefixes go first, then preemption.
    sched = _scheduler(kept)
    for i in range(4):
        sched.submit(Unit([_seq(10 + i, [i + 2] * 60, 10, f"r{i}")]))
    _drive(sched, lambda s: 5)
    assert sched.preemptions > 0 and "e2" not in kept.entries
    kept.drop_all("released")
    assert kept.alloc.referenced == 0 and kept.alloc.free == 4


def test_the_allocator_grows_and_refuses_a_release_without_a_reference():
    alloc = PageAllocator(3)
    assert alloc.alloc(2) == [1, 2]
    alloc.grow(5)
    assert alloc.alloc(2) == [3, 4] and alloc.free == 0
    alloc.release([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="page 1 released with no reference"):
        alloc.release([1])


# ------------------------------------------------------------- the engine (tiny model) --

PROMPT = "the count is {i} and the next one is higher than this: "  # ~55 characters: turn 2 crosses a page
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=120, step_timeout_s=10.0)
CFG = sampling(temperature=0.9, max_new_tokens=10)


def _request(n: int) -> EpisodeRequest:
    specs = tuple(EpisodeSpec(f"g{i // 2}", i % 2, EpisodeProblem(f"p{i}", PROMPT.format(i=i // 2), "x"),
                              seed=1000 + 31 * i) for i in range(n))
    return EpisodeRequest("test-feedback", {}, LIMITS, specs, CFG, 2)


def _engine(model_dir, **options) -> TorchEngine:
    engine = TorchEngine(TorchEngineConfig(dtype="float32", numerics="true_on_policy", **options))
    engine.load(str(model_dir), 0)
    return engine


def _bits(episodes) -> list:
    return [(e.sample_id, e.prompt_ids, e.response_ids, e.response_mask,
             [struct.pack("<f", x) for x in e.logprobs], e.end_reason) for e in episodes]


def _run(engine: TorchEngine, request: EpisodeRequest):
    episodes = engine.run_episodes(request)
    counts = engine.take_prefill_counts()
    kept = engine._decoder.kept_prefixes
    assert not kept.entries and kept.alloc.referenced == 0  # the call ended: no page is held
    return episodes, counts


def test_reuse_gives_the_bits_of_re_prefill_and_prefills_only_each_turns_suffix(decoder_model_dir):
    request = _request(6)
    baseline, full = _run(_engine(decoder_model_dir, episode_kv_reuse=False, max_batch_size=8), request)
    assert full.reused_tokens == 0 and full.misses == {}
    assert all(e.turns == 3 and e.end_reason is EndReason.MAX_TURNS for e in baseline)
    assert max(e.length for e in baseline) > KEY_BLOCK  # contexts cross a page
    reused, counts = _run(_engine(decoder_model_dir, max_batch_size=8), request)
    assert _bits(reused) == _bits(baseline)
    # Turns 2 and 3 of each of the 6 episodes prefill the last sampled token and the observation only.
    assert counts.misses == {} and counts.prefill_tokens + counts.reused_tokens == full.prefill_tokens
    turn_one = 3 * len(PROMPT.format(i=0))  # three groups of two episodes share their prompt's prefill
    assert counts.prefill_tokens == turn_one + 6 * 2 * (1 + len(" try 1: "))


def test_reuse_under_pool_pressure_and_chunked_prefill_still_gives_the_bits_of_re_prefill(decoder_model_dir):
    """Longer turns in a four-page pool, six rows, 5-token prefill chunks: kept prefixes are evicted (and
    counted), running sequences preempted and recomputed; the episodes keep their bits."""
    request = replace(_request(6), sampling=replace(CFG, max_new_tokens=24))
    baseline, full = _run(_engine(decoder_model_dir, episode_kv_reuse=False, max_batch_size=8), request)
    engine = _engine(decoder_model_dir, max_batch_size=6, prefill_chunk_tokens=5, kv_cache_tokens=4 * KEY_BLOCK)
    preemptions, decode = [], engine._decoder.decode

    def counted(*args, **kwargs):
        out = decode(*args, **kwargs)
        preemptions.append(engine._decoder.stats.preemptions)
        return out

    engine._decoder.decode = counted
    squeezed, counts = _run(engine, request)
    assert _bits(squeezed) == _bits(baseline)
    assert counts.misses.get("evicted", 0) > 0 and sum(preemptions) > 0 and counts.reused_tokens > 0
    assert counts.prefill_tokens < full.prefill_tokens


def test_a_weight_update_drops_kept_prefixes_and_the_next_turn_re_prefills(decoder_model_dir):
    engine = _engine(decoder_model_dir, max_batch_size=4)
    contexts = [[5, 6, 7, 8], [9, 10, 11]]
    turns = engine.sample_turns(contexts, [1, 2], CFG, ["a", "b"])
    kept = engine._decoder.kept_prefixes
    assert set(kept.entries) == {"a", "b"} and kept.alloc.referenced > 0
    engine.take_prefill_counts()
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    engine.update_weights(state, 1)
    assert not kept.entries and kept.alloc.referenced == 0
    nxt = [c + t.token_ids + [3] for c, t in zip(contexts, turns)]
    engine.sample_turns(nxt, [3, 4], CFG, ["a", "b"])
    counts = engine.take_prefill_counts()
    assert counts.misses == {"weights": 2} and counts.reused_tokens == 0
    assert counts.prefill_tokens == sum(len(c) for c in nxt)
    engine.episodes_ended(["a", "b"])
    assert not kept.entries and kept.alloc.referenced == 0
