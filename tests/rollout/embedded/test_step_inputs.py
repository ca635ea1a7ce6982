"""The decoder's staged step inputs: incremental block-table updates equal a full rebuild at every step.

Pure host logic (no model): sequences whose pages grow, whose shared last page is replaced (copy on write),
that move to another row when an earlier row finishes, that leave and come back with other pages after a
preemption, and padded rows that must decode the pad token into the scratch page.
"""
from __future__ import annotations

import torch

from services.rollout.embedded.kv_cache import SCRATCH_PAGE
from services.rollout.embedded.scheduler import DecodeSequence
from services.rollout.embedded.step_inputs import StepInputs

PAD = 7
WIDTH = 6


def seq(index: int, pages: list[int], computed: int) -> DecodeSequence:
    tokens = [100 + index * 10 + i for i in range(computed + 1)]
    return DecodeSequence(index=index, prompt_len=1, tokens=tokens, max_tokens=99, pages=list(pages), computed=computed)


def staged_rows(inputs: StepInputs, rows: list[DecodeSequence], bucket: int) -> dict:
    context = inputs.stage(rows, bucket, PAD)
    return {"context": context, "ids": inputs.ids[:bucket, 0].tolist(),
            "positions": inputs.positions[:bucket, 0].tolist(), "lengths": inputs.lengths[:bucket].tolist(),
            "tables": [inputs.tables[b, :len(s.pages)].tolist() for b, s in enumerate(rows)],
            "pad_pages": inputs.tables[len(rows):bucket, 0].tolist()}


def rebuilt(rows: list[DecodeSequence], bucket: int) -> dict:
    """What every step must stage: each row's own pages, token and position; padded rows on the scratch page."""
    n = len(rows)
    return {"context": sum(s.computed + 1 for s in rows),
            "ids": [s.tokens[s.computed] if s.finish_reason is None else PAD for s in rows] + [PAD] * (bucket - n),
            "positions": [s.computed for s in rows] + [0] * (bucket - n),
            "lengths": [s.computed + 1 for s in rows] + [1] * (bucket - n),
            "tables": [list(s.pages) for s in rows], "pad_pages": [SCRATCH_PAGE] * (bucket - n)}


def advance(s: DecodeSequence, token: int) -> None:
    s.tokens.append(token)
    s.computed += 1


def test_incremental_tables_equal_a_full_rebuild_through_growth_copy_on_write_reorder_and_preemption():
    inputs = StepInputs(rows=4, table_width=WIDTH, device=torch.device("cpu"))
    a, b, c = seq(0, [3, 4], 70), seq(1, [3, 5], 70), seq(2, [9], 10)

    def check(rows, bucket):
        assert staged_rows(inputs, rows, bucket) == rebuilt(rows, bucket)

    check([a, b, c], 4)
    # a enters a new page; b's shared last page is replaced by its private copy (same page count).
    a.pages.append(11)
    b.pages[1] = 12
    advance(a, 1), advance(b, 2), advance(c, 3)
    check([a, b, c], 4)
    # a finishes: b and c move up a row each (another sequence's old table entries sit in those rows).
    check([b, c], 2)
    # b is preempted and readmitted with other pages while c keeps its row; c's row grows.
    b.pages, b.computed = [], 0
    c.pages.append(13)
    advance(c, 4)
    check([c], 1)
    b.pages, b.computed = [20, 21], 71
    check([c, b], 2)
    # A finished row of a static batch is fed the pad token at its position.
    c.finish_reason = "stop"
    check([c, b], 2)


def test_padded_rows_read_the_scratch_page_after_real_rows_used_them():
    inputs = StepInputs(rows=4, table_width=WIDTH, device=torch.device("cpu"))
    rows = [seq(i, [i + 1, i + 5], 80) for i in range(4)]
    assert staged_rows(inputs, rows, 4) == rebuilt(rows, 4)
    assert staged_rows(inputs, rows[:1], 4) == rebuilt(rows[:1], 4)  # rows 1..3 now padding


def test_a_new_decode_forgets_the_previous_rows():
    inputs = StepInputs(rows=2, table_width=WIDTH, device=torch.device("cpu"))
    s = seq(0, [1, 2, 3], 150)
    inputs.stage([s], 1, PAD)
    inputs.reset()
    # The same object, its pages rewritten behind the staging's back (a new request reuses nothing staged).
    s.pages[0], s.pages[1] = 8, 9
    assert staged_rows(inputs, [s], 1) == rebuilt([s], 1)


def test_stream_keys_are_each_members_index_and_step():
    inputs = StepInputs(rows=3, table_width=WIDTH, device=torch.device("cpu"))
    members = [seq(5, [1], 3), seq(2, [2], 0)]
    members[0].prompt_len = 2
    idx, steps = inputs.keys(members)
    assert idx.tolist() == [5, 2] and steps.tolist() == [len(members[0].tokens) - 2, 0]
