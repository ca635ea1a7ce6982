"""The 'math' task: JSONL problems, math-verify rewards (in worker processes), submit-time refusals."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.coordinator.tasks import build_task
from services.coordinator.tasks.math_dataset import MathConfig, MathTask, math_reward, reference_answer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def gsm8k_like(tmp_path) -> Path:
    rows = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
             "answer": f"He has {i} + {i + 1} = {2 * i + 1} apples.\n#### {2 * i + 1}"} for i in range(20)]
    return write_jsonl(tmp_path / "train.jsonl", rows)


@pytest.mark.parametrize("answer, response, expected", [
    ("42", "The answer is \\boxed{42}.", 1.0),
    ("42", "The answer is \\boxed{41}.", 0.0),
    ("\\frac{1}{2}", "so we get \\boxed{0.5}", 1.0),       # equal value, other form
    ("1234", "Total: \\boxed{1,234}", 1.0),                # thousands separator
    ("x^2 + 2x + 1", "\\boxed{(x+1)^2}", 1.0),             # symbolic equality
    ("42", "", 0.0),
    ("42", "I do not know<|im_end|>", 0.0),
    ("42", "\\boxed{42}<|im_end|><|endoftext|>", 1.0),     # special tokens kept by the decoder
])
def test_reward_is_math_verify_equivalence(answer, response, expected):
    # A generous timeout: what is checked is the verdict, and a symbolic check on a starved CI core (the
    # unit tests run at nice 10 beside the stack) once took over 5 s. A verdict returns as soon as it is made.
    assert math_reward(answer, response, timeout_s=60) == (expected, False)


def test_reference_answer_takes_the_text_after_the_last_marker():
    assert reference_answer("3 + 4 = 7\n#### 7 ", "####") == "7"
    assert reference_answer(" 7 ", "") == "7"
    with pytest.raises(ValueError, match="does not contain answer_marker"):
        reference_answer("7", "####")


def test_splits_are_disjoint_seeded_and_prompts_follow_the_template(gsm8k_like):
    cfg = MathConfig(path=str(gsm8k_like), answer_marker="####", heldout_size=5, seed=1,
                     prompt_template="Q: {question}\nA:")
    task = MathTask(cfg)
    train, held = task.split("train"), task.split("heldout")
    assert len(held) == 5 and len(train) == 15
    assert not {p.problem_id for p in train} & {p.problem_id for p in held}
    assert [p.problem_id for p in MathTask(cfg).split("heldout")] == [p.problem_id for p in held]
    assert [p.problem_id for p in MathTask(MathConfig(**{**cfg.__dict__, "seed": 2})).split("heldout")] != \
        [p.problem_id for p in held]
    p = train[0]
    assert p.prompt.startswith("Q: Tom has") and p.prompt.endswith("\nA:")
    assert p.answer == str(2 * int(p.prompt.split("has ")[1].split()[0]) + 1)  # the text after ####


def test_score_in_worker_processes_equals_inline_reward(gsm8k_like):
    task = MathTask(MathConfig(path=str(gsm8k_like), answer_marker="####", heldout_size=5, reward_workers=2))
    try:
        problems = list(task.split("train"))[:6]
        responses = [f"\\boxed{{{p.answer}}}" if i % 2 == 0 else f"\\boxed{{{int(p.answer) + 1}}}"
                     for i, p in enumerate(problems)]
        scored = asyncio.run(task.score(list(zip(problems, responses))))
        assert scored == [1.0, 0.0] * 3
        assert scored == [task.reward(p, r) for p, r in zip(problems, responses)]
        assert task.reward_timeouts == 0
    finally:
        task.close()


def test_separate_heldout_file(gsm8k_like, tmp_path):
    held = write_jsonl(tmp_path / "test.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    task = MathTask(MathConfig(path=str(gsm8k_like), heldout_path=str(held), answer_marker="####"))
    assert len(task.split("train")) == 20 and [p.answer for p in task.split("heldout")] == ["2"]


@pytest.mark.parametrize("rows, options, message", [
    (None, {"path": "/nonexistent.jsonl"}, "path: no such file '/nonexistent.jsonl'"),
    (["{not json"], {}, "path: line 1 is not JSON"),
    ([{"question": "q", "answer": "1"}, {"prompt": "q", "answer": "2"}], {}, "question_field: line 2"),
    ([{"question": "q", "answer": 3}], {}, "answer_field: line 1"),
    ([{"question": "q", "answer": "no marker"}], {"answer_marker": "####"}, "does not contain answer_marker"),
    ([{"question": "q", "answer": "#### ??"}], {"answer_marker": "####"}, "math-verify cannot read the answer '??'"),
    ([{"question": "q", "answer": "1"}] * 3, {"heldout_size": 3}, "heldout_size: 3 leaves no training problems"),
    ([{"question": "q", "answer": "1"}] * 3, {"heldout_size": 1, "prompt_template": "no field"},
     "prompt_template: has no {question} field"),
    ([{"question": "q", "answer": "1"}] * 3, {"heldout_size": 1, "prompt_template": "{question} {other}"},
     "prompt_template: must have one {question} field"),
    ([{"question": "q", "answer": "1"}] * 3, {"heldout_size": 1, "heldout_path": "/none.jsonl"},
     "heldout_path: no such file"),
])
def test_bad_dataset_or_options_are_refused_when_the_task_is_built(tmp_path, rows, options, message):
    opts = dict(options)
    if rows is not None:
        path = tmp_path / "d.jsonl"
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        opts.setdefault("path", str(path))
    with pytest.raises(ValueError) as err:
        build_task("math", opts)
    assert message in str(err.value)


def test_unknown_option_is_refused_naming_it():
    with pytest.raises(ValueError, match="math.*options.*questoin_field"):
        build_task("math", {"path": "x", "questoin_field": "q"})
