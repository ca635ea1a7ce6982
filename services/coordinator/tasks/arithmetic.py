"""Multi-digit addition: the demo's verifiable task, generated in code from a seed.

A problem is `"{a}+{b}="` with both operands drawn uniformly from the
`digits`-digit numbers; the reference answer is the decimal sum. The policy
is expected to write the answer and then eos; the reward is 1.0 only for an
exactly correct answer (see `parse_answer`), so partial credit cannot be
gamed and the signal is unambiguous.

Splits: `heldout` is a fixed sample of `heldout_size` problems; `train` is
up to `train_size` of the remaining ones. Disjointness is over *unordered*
operand pairs: if `12+34=` is held out then `34+12=` is never trained on, so
held-out accuracy measures addition the model has not seen in either order.
Each unordered pair appears at most once (in a random operand order), so with
2 digits `train` is all 4095 - heldout_size remaining pairs. Both splits are
pure functions of (seed, digits, heldout_size, train_size).

Optionally (`reverse_answer`) the answer is written least-significant digit
first, the order in which carries propagate; small transformers learn that
form far faster. The demo keeps normal order unless the recipe says otherwise.
"""
from __future__ import annotations

import json
import random
from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.coordinator.tasks.base import Problem, Task


EOS_TEXT = "<|eos|>"
"""How a response's end reads when the run's tokenizer keeps special tokens in decoded text: the demo's
character tokenizer (recipes/char_tokenizer.py) writes its eos so; a test keeps the two equal."""
MAX_TRAIN_SIZE = 200_000
"""Largest train split a run may ask for: the split is built in memory when the run is submitted."""
MAX_EVAL_SET_BYTES = 16 * 1024 * 1024
"""Largest eval-set file: it is read when the run is submitted (100,000 operand pairs take ~3 MiB)."""
MAX_EVAL_SET_LINES = 100_000
"""Most problems in one eval-set file."""
MAX_OPERAND = 10**9 - 1
"""Largest operand of an eval-set problem (the task's own problems have at most 9 digits)."""


class ArithmeticConfig(BaseModel):
    """Which addition problems exist and how they split (the run spec's task.options)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    seed: int = Field(0, ge=0, le=2**62, description="Seeds the draw of both splits; same seed -> same problems "
                      "in the same order.")
    digits: int = Field(2, ge=1, le=9, description="Digits per operand (2 -> operands 10..99). Leading zeros are "
                        "never written.")
    heldout_size: int = Field(200, ge=1, le=100_000, description="Problems in the held-out split (greedy eval set).")
    train_size: int = Field(20000, ge=1, le=MAX_TRAIN_SIZE, description="Problems in the train split, capped by "
                            "how many unordered pairs remain.")
    reverse_answer: bool = Field(False, description="Write the answer least-significant digit first (reference "
                                 "and expected response).")

    @model_validator(mode="after")
    def _leaves_training_problems(self) -> "ArithmeticConfig":
        n_pairs = self.num_unordered_pairs
        if self.heldout_size >= n_pairs:
            raise ValueError(
                f"heldout_size: {self.heldout_size} leaves no training problems"
                f" ({n_pairs} unordered pairs of {self.digits}-digit numbers)"
            )
        return self

    @property
    def operand_range(self) -> tuple[int, int]:
        lo = 10 ** (self.digits - 1) if self.digits > 1 else 0
        return lo, 10**self.digits - 1

    @property
    def num_unordered_pairs(self) -> int:
        lo, hi = self.operand_range
        n = hi - lo + 1
        return n * (n + 1) // 2


def format_answer(value: int, reverse: bool) -> str:
    s = str(value)
    return s[::-1] if reverse else s


def parse_answer(response_text: str) -> str | None:
    """The answer a response commits to, or None when it does not commit to one.

    The response ends at the first eos (when the decoder kept special tokens)
    and anything after it is ignored. What is left, without surrounding
    whitespace, must be one run of ASCII digits; anything else — empty, signs,
    spaces inside, letters, a second number, a special token such as pad in
    the middle — is no answer. Strict on purpose: a lenient parser ("first
    number in the text") would reward responses that hedge with several numbers.
    """
    if not isinstance(response_text, str):
        return None
    text = response_text.split(EOS_TEXT, 1)[0].strip()
    if not text or len(text) > 32:
        return None
    if not all("0" <= c <= "9" for c in text):  # str.isdigit() accepts '²' and other Unicode digits
        return None
    return text


def _operand(row: dict, key: str, where: str) -> int:
    value = row.get(key)
    if type(value) is not int or not 0 <= value <= MAX_OPERAND:  # type(): a JSON true is no operand
        raise ValueError(f"{where}: {key!r} must be an integer in [0, {MAX_OPERAND}], got {value!r}")
    return value


def parse_eval_lines(lines: list[str], path: str, field: str, cfg: ArithmeticConfig) -> list[Problem]:
    """Problems from JSONL lines `{"a": 12, "b": 34}`: prompt and answer are written as the task writes its own."""
    name = Path(path).name
    problems = []
    for n, line in enumerate(lines, start=1):
        if n > MAX_EVAL_SET_LINES:
            raise ValueError(f"{field}: {path} has more than {MAX_EVAL_SET_LINES} lines")
        if not line.strip():
            continue
        where = f"{field}: line {n} of {path}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{where} is not JSON ({getattr(exc, 'msg', 'nested too deeply')})") from None
        if not isinstance(row, dict) or set(row) != {"a", "b"}:
            raise ValueError(f"{where} must be an object with exactly the keys 'a' and 'b'")
        a, b = _operand(row, "a", where), _operand(row, "b", where)
        problems.append(Problem(f"{name}:{n}-{a}+{b}", f"{a}+{b}=", format_answer(a + b, cfg.reverse_answer)))
    if not problems:
        raise ValueError(f"{field}: {path} holds no problems")
    return problems


def read_eval_set(path: str, field: str, cfg: ArithmeticConfig) -> list[Problem]:
    """An extra held-out set from a JSONL file of operand pairs (see parse_eval_lines)."""
    p = Path(path)
    try:
        if not p.is_file():
            raise ValueError(f"{field}: no such file {path!r}")
        size = p.stat().st_size
        if size > MAX_EVAL_SET_BYTES:
            raise ValueError(f"{field}: {path} has {size} bytes, more than the {MAX_EVAL_SET_BYTES} allowed")
        text = p.read_text(encoding="utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{field}: {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path!r} ({exc.strerror})") from None
    return parse_eval_lines(text.splitlines(), path, field, cfg)


class ArithmeticTask(Task):
    """`Task` over `ArithmeticConfig`; splits are built once, on first use."""

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig | None = None):
        self.config = config or ArithmeticConfig()

    @cached_property
    def _splits(self) -> dict[str, tuple[Problem, ...]]:
        cfg = self.config
        lo, hi = cfg.operand_range
        rng = random.Random(f"arithmetic/{cfg.seed}/{cfg.digits}")
        n_pairs = cfg.num_unordered_pairs
        train_target = min(cfg.train_size, n_pairs - cfg.heldout_size)

        def key(a: int, b: int) -> tuple[int, int]:
            return (a, b) if a <= b else (b, a)

        def draw_unique(count: int, taken: set[tuple[int, int]]) -> list[tuple[int, int]]:
            # Rejection sampling is fine while the target is a minority of the
            # pairs; when it is not, enumerate and shuffle instead (exact, and
            # avoids a coupon-collector tail).
            out: list[tuple[int, int]] = []
            if count + len(taken) > n_pairs // 2:
                pool = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1) if (a, b) not in taken]
                rng.shuffle(pool)
                for a, b in pool[:count]:
                    out.append((a, b) if rng.random() < 0.5 else (b, a))
                taken.update(key(a, b) for a, b in out)
                return out
            while len(out) < count:
                a, b = rng.randint(lo, hi), rng.randint(lo, hi)
                k = key(a, b)
                if k in taken:
                    continue
                taken.add(k)
                out.append((a, b))
            return out

        taken: set[tuple[int, int]] = set()
        heldout = draw_unique(cfg.heldout_size, taken)
        train = draw_unique(train_target, taken)
        return {
            "heldout": tuple(self._problem("heldout", i, a, b) for i, (a, b) in enumerate(heldout)),
            "train": tuple(self._problem("train", i, a, b) for i, (a, b) in enumerate(train)),
        }

    def _problem(self, split: str, index: int, a: int, b: int) -> Problem:
        return Problem(
            problem_id=f"{split}-{index:06d}-{a}+{b}",
            prompt=f"{a}+{b}=",
            answer=format_answer(a + b, self.config.reverse_answer),
        )

    def split(self, name: str) -> tuple[Problem, ...]:
        try:
            return self._splits[name]
        except KeyError:
            raise ValueError(f"split: unknown {name!r}, expected 'train' or 'heldout'") from None

    def reward(self, problem: Problem, response_text: str) -> float:
        answer = parse_answer(response_text)
        return 1.0 if answer is not None and answer == problem.answer else 0.0

    def target_text(self, problem: Problem) -> str:
        """The response a perfect policy writes, before eos (used by the supervised warm start)."""
        return problem.answer
