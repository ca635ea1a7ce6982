"""The tiny code demo: a character-level policy writes a Python expression, rewarded only by running it.

A problem shows one example of an operation on two digits and asks for the function:

    3*4==12
    f=lambda a,b:

The program run in the sandbox is the prompt followed by the response (the `code` task's completion
rule), and check() calls `f` on the example's digits and on a second pair the prompt does not show. The
intended response is the expression `a*b`; the literal `12` satisfies the shown example only and fails
the hidden one. Nothing but execution decides the reward.

Why the warm start is built this way (the tiny_tools demo's design): it shows the expression on a small
share of its examples only (`expression_fraction`), the literal on the rest. Both are copies a 2-layer
model learns quickly, so the warm-started policy writes either form correctly but greedily prefers the
literal (held-out accuracy near 0), while temperature-1 samples write the expression now and then, and
only those pass. RL has one thing to learn from reward alone: write the expression.

What this package pins, so every part agrees:
- `MODEL`: the tiny Qwen3 shape (recipes/tiny_arith's);
- `problems()`: every problem, a pure function of nothing (243 of them: digits 1-9, three operators);
- `HELDOUT_SIZE`, `SPLIT_SEED`: recipe.yaml's task options must hold out exactly these (a test checks it),
  or the run's held-out problems could be ones the warm start trained on;
- `WarmStartConfig`: the supervised warm start (prepare.py runs it).
"""
from __future__ import annotations

from dataclasses import dataclass

from recipes.tiny_arith import MODEL  # noqa: F401 - the same tiny Qwen3 shape as the other demos

OPERATORS = ("+", "-", "*")
HELDOUT_SIZE = 64
SPLIT_SEED = 0
PROBLEMS_FILE = "problems.jsonl"
"""Written by prepare.py beside the model; the run spec's task.options.path names it."""


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _hidden_pair(op: str, a: int, b: int) -> tuple[int, int]:
    """The second pair check() tries: the first one, shifted, where the operation's value differs from the
    shown one (so a literal copy of the shown value fails it)."""
    for shift in range(1, 9):
        c, d = (a + shift) % 9 + 1, (b + 2 * shift) % 9 + 1
        if _apply(op, c, d) != _apply(op, a, b):
            return c, d
    raise AssertionError("unreachable: some shift changes the value")


def prompt_of(op: str, a: int, b: int) -> str:
    return f"{a}{op}{b}=={_apply(op, a, b)}\nf=lambda a,b:"


def problems() -> list[dict]:
    """Every problem as a HumanEval-format row (task_id, prompt, entry_point, test), plus the two answers a
    warm start writes: `expression` (passes) and `literal` (the shown value: fails the hidden pair)."""
    rows = []
    for op in OPERATORS:
        for a in range(1, 10):
            for b in range(1, 10):
                c, d = _hidden_pair(op, a, b)
                test = (f"def check(candidate):\n    assert candidate({a}, {b}) == {_apply(op, a, b)}\n"
                        f"    assert candidate({c}, {d}) == {_apply(op, c, d)}\n")
                rows.append({"task_id": f"tiny_code/{a}{op}{b}", "prompt": prompt_of(op, a, b), "entry_point": "f",
                             "test": test, "expression": f"a{op}b", "literal": str(_apply(op, a, b))})
    return rows


TASK_OPTIONS: dict = {"seed": SPLIT_SEED, "heldout_size": HELDOUT_SIZE, "reward": "all_pass",
                      "sandbox": {"wall_s": 5.0, "cpu_s": 2, "memory_mb": 256, "processes": 8}}
"""The code task's options but `path` (the demo fills it with prepare's problems file)."""


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start: cross-entropy on response + eos tokens of train problems."""

    steps: int = 150
    """Optimizer steps (a fixed count: the warm start is deterministic per seed)."""
    batch_size: int = 64
    expression_fraction: float = 0.2
    """Share of examples answered with the expression; the rest with the literal. Low on purpose: greedy
    decoding should prefer the literal (and fail), while sampling still writes the expression."""
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 20
    grad_clip: float = 1.0
    num_threads: int = 1
    """torch CPU threads, pinned: bitwise-identical weights need a fixed reduction order."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.expression_fraction <= 1.0:
            raise ValueError(f"expression_fraction: must be in [0, 1], got {self.expression_fraction}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")


WARM_START = WarmStartConfig()
