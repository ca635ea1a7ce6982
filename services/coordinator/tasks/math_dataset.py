"""Math word problems from a local data file, rewarded by math-verify.

JSONL by default (or Parquet, or a saved Hugging Face dataset: options.dataset, prompt_rows.py; a chat
in `dataset.messages_field` instead of a question, rendered by the model's chat template). One JSON object
per line, with the question and the reference answer in
configurable fields (GSM8K's "question"/"answer", with its "#### 42" final
answer marker, MATH's "problem"/"solution" with a \\boxed{} answer, ...). The
prompt is `prompt_template` with the question filled in; the reward is 1.0
when math-verify finds, in the response, an answer mathematically equal to the
reference (`\\boxed{0.5}` for `\\frac{1}{2}`, `1,234` for `1234`), else 0.0.

Every reference answer is parsed when the task is built, i.e. when a run is
submitted: a file with an answer math-verify cannot read is refused then, with
its line number, instead of rewarding 0 for that problem for the whole run.

Responses are model output, so they are parsed and verified in worker
processes with math-verify's own timeouts (signal.alarm, which only works in a
process's main thread): a response that sends sympy into a very long
computation costs that sample its reward (0.0, logged and counted in
`reward_timeouts`), never the coordinator's event loop.

Splits: `heldout_path` names a separate held-out file; without it the first
`heldout_size` problems of a seeded shuffle are held out and the rest train.
Both are pure functions of the file(s) and (seed, heldout_size).

The options and the file format (fields, answer marker, limits) are
contract/data/math_options.py, which `lockstep recipe prepare` checks files with.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import random
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import cached_property, lru_cache
from pathlib import Path

from contract.data.math_options import MathConfig, reference_answer
from services.coordinator.tasks.base import Problem, Task
from services.coordinator.tasks.prompt_rows import data_format, read_rows, row_word

MATH_VERIFY_HINT = "math-verify is not installed: pip install 'math-verify==0.9.0' (pinned in requirements.lock)"
log = logging.getLogger("lockstep.coordinator.tasks.math")
# math-verify warns on every call made without its timeout; that is the point on gold answers.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _math_verify():
    try:
        import math_verify
    except ImportError as exc:
        raise RuntimeError(MATH_VERIFY_HINT) from exc
    return math_verify


def _parse_reference(answer: str):
    """Gold answers come from the dataset, not the model: parsed without timeouts (any thread)."""
    mv = _math_verify()
    # As LaTeX math ("x^2 + 2x + 1" would otherwise be read as its last number);
    # no fallback to the raw string, so an answer math-verify cannot read is refused.
    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return mv.parse(text, parsing_timeout=None, fallback_mode="no_fallback")


def preload() -> None:
    """Import math-verify (sympy, the LaTeX parser) and parse one answer now, if it is installed: the
    coordinator does this before it starts serving, so the first submit does not import it in a worker
    thread (holding the GIL for the whole import) and the import's objects can be frozen out of the GC."""
    try:
        _parse_reference("1")
    except RuntimeError:  # not installed: a math run is refused at submit with the install hint
        pass


@lru_cache(maxsize=65536)
def _cached_reference(answer: str):
    return _parse_reference(answer)


def math_reward(answer: str, response: str, timeout_s: int) -> tuple[float, bool]:
    """(reward, timed_out) of one response. Runs in a worker process's main thread (signal timeouts)."""
    mv = _math_verify()
    from math_verify.errors import TimeoutException

    try:
        predicted = mv.parse(response, parsing_timeout=timeout_s, raise_on_error=True)
        ok = mv.verify(_cached_reference(answer), predicted, timeout_seconds=timeout_s, raise_on_error=True)
    except TimeoutException:
        return 0.0, True
    except Exception:  # unparseable output is a wrong answer, not an error of the run
        return 0.0, False
    return (1.0 if ok else 0.0), False


def _chat(row: dict, n: int, where: str, path: str, field: str) -> tuple[tuple[str, str], ...]:
    """A row's chat messages as (role, content) pairs; refused naming the file, row and field."""
    messages = row.get(field)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"dataset.messages_field: {where} {n} of {path} has no non-empty list field {field!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"dataset.messages_field: {where} {n} of {path}: {field}[{i}] is not a "
                             "{role, content} message of strings")
        out.append((m["role"], m["content"]))
    return tuple(out)


def _parse_problems(rows: Iterable[tuple[int, object]], path: str, field_prefix: str, cfg: MathConfig,
                    where: str) -> list[Problem]:
    name = Path(path).name
    messages_field = cfg.dataset.messages_field
    problems: list[Problem] = []
    for n, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{field_prefix}: {where} {n} is not a JSON object")
        wanted = (cfg.answer_field,) if messages_field else (cfg.question_field, cfg.answer_field)
        for field in wanted:
            if not isinstance(row.get(field), str):
                which = "question_field" if field == cfg.question_field else "answer_field"
                raise ValueError(f"{which}: {where} {n} of {path} has no string field {field!r}")
        try:
            answer = reference_answer(row[cfg.answer_field], cfg.answer_marker)
        except ValueError as exc:
            raise ValueError(f"answer_field: {where} {n} of {path}: {cfg.answer_field!r} {exc}") from None
        if not _parse_reference(answer):
            raise ValueError(f"answer_field: {where} {n} of {path}: math-verify cannot read the answer {answer!r}")
        if messages_field:
            chat = _chat(row, n, where, path, messages_field)
            problems.append(Problem(f"{name}:{n}", chat[-1][1], answer, messages=chat))
        else:
            problems.append(Problem(f"{name}:{n}", cfg.prompt_template.format(question=row[cfg.question_field]),
                                    answer))
    return problems


def _read_problems(path: str, field_prefix: str, cfg: MathConfig) -> list[Problem]:
    where = row_word(data_format(Path(path), cfg.dataset))
    problems = _parse_problems(read_rows(path, field_prefix, cfg.dataset), path, field_prefix, cfg, where)
    if not problems:
        raise ValueError(f"{field_prefix}: {path} holds no problems")
    return problems


def read_eval_set(path: str, field: str, cfg: MathConfig) -> list[Problem]:
    """An extra held-out set: a JSONL file in the same format as `path`, read and checked the same way."""
    return _read_problems(path, field, cfg)


class MathTask(Task):
    name = "math"

    def __init__(self, config: MathConfig) -> None:
        self.config = config
        self._validate()
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.reward_timeouts = 0

    @property
    def chat_prompts(self) -> bool:
        """Whether the problems are chats, for the run's PromptTokens to render with the chat template."""
        return bool(self.config.dataset.messages_field)

    def _validate(self) -> None:
        cfg = self.config
        if not cfg.path:
            raise ValueError("path: required (a JSONL file of problems)")
        if not cfg.heldout_path:
            n = len(self._train_file)
            if cfg.heldout_size >= n:
                raise ValueError(f"heldout_size: {cfg.heldout_size} leaves no training problems ({n} in {cfg.path})")
        self._splits  # read and check the held-out file too, now

    @cached_property
    def _train_file(self) -> list[Problem]:
        return _read_problems(self.config.path, "path", self.config)

    @cached_property
    def _splits(self) -> dict[str, tuple[Problem, ...]]:
        cfg = self.config
        if cfg.heldout_path:
            return {"train": tuple(self._train_file),
                    "heldout": tuple(_read_problems(cfg.heldout_path, "heldout_path", cfg))}
        order = list(range(len(self._train_file)))
        random.Random(f"math/{cfg.seed}").shuffle(order)
        held = set(order[: cfg.heldout_size])
        return {"heldout": tuple(self._train_file[i] for i in sorted(held)),
                "train": tuple(p for i, p in enumerate(self._train_file) if i not in held)}

    def split(self, name: str) -> Sequence[Problem]:
        if name not in ("train", "heldout"):
            raise ValueError(f"split: {name!r} is not 'train' or 'heldout'")
        return self._splits[name]

    def reward(self, problem: Problem, response_text: str) -> float:
        """One response, in this process (main thread only: math-verify's timeouts use signals)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("MathTask.reward: call score() outside the main thread (math-verify uses signal.alarm)")
        value, timed_out = math_reward(problem.answer, response_text, self.config.timeout_s)
        self.reward_timeouts += timed_out
        return value

    async def score(self, items: Sequence[tuple[Problem, str]]) -> list[float]:
        loop = asyncio.get_running_loop()
        pool = self._executor()
        results = await asyncio.gather(*(
            loop.run_in_executor(pool, math_reward, p.answer, text, self.config.timeout_s) for p, text in items
        ))
        timed_out = sum(t for _, t in results)
        if timed_out:
            log.warning("math-verify timed out on %d of %d responses (reward 0.0)", timed_out, len(results))
        self.reward_timeouts += timed_out
        return [v for v, _ in results]

    def _executor(self) -> ProcessPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                _math_verify()  # fail here, with the hint, not inside a worker
                # spawn, not fork: the coordinator has gRPC and event-loop threads that a fork would copy mid-flight.
                self._pool = ProcessPoolExecutor(max_workers=self.config.reward_workers,
                                                 mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
