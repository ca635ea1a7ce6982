"""The tool demo's parts: its recipe agrees with the warm start, and scripted episodes mask the tool's text."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml

from recipes.char_tokenizer import EOS_ID, build_char_tokenizer
from recipes.tiny_tools import TASK_OPTIONS, WARM_START
from recipes.tiny_tools.episodes import IGNORE, scripted_batches, scripted_episode
from services.coordinator.run_spec import RunSpec
from services.coordinator.tasks.episodic import CalculatorConfig, CalculatorTask
from services.environments.calculator import evaluate

REPO = Path(__file__).resolve().parents[2]


def _task() -> CalculatorTask:
    return CalculatorTask(CalculatorConfig.model_validate(TASK_OPTIONS, strict=False))


def test_recipe_uses_the_task_the_warm_start_trained_on(tmp_path):
    recipe = yaml.safe_load((REPO / "recipes" / "tiny_tools" / "recipe.yaml").read_text())
    # Same split seed, digits and sizes, or the run's held-out set overlaps the warm start's training data.
    assert recipe["task"]["name"] == "calculator"
    assert recipe["task"]["options"] == TASK_OPTIONS
    assert recipe["numerics"] == "true_on_policy"
    # A turn must fit the longest intended one: `<calc>a*b</calc>` and eos.
    call = len(f"<calc>{'9' * TASK_OPTIONS['digits']}*{'9' * TASK_OPTIONS['digits']}</calc>") + 1
    assert recipe["rollout"]["sampling"]["max_new_tokens"] >= call
    from recipes.tiny_model import build_model_dir
    from recipes.tiny_tools import MODEL

    # The spec is valid as written once model_path names a model of the demo's shape.
    recipe["model_path"] = str(build_model_dir(tmp_path / "m", MODEL, seed=0))
    RunSpec.model_validate(recipe)


def test_splits_hold_products_too_large_to_guess():
    task = _task()
    heldout, train = task.split("heldout"), task.split("train")
    assert len(heldout) == TASK_OPTIONS["heldout_size"] and len(train) == TASK_OPTIONS["train_size"]
    assert all(int(p.answer) >= 100 * 100 for p in heldout)
    assert not {p.prompt for p in heldout} & {p.prompt for p in train}


def test_scripted_episode_trains_the_model_tokens_only():
    tok = build_char_tokenizer()
    problem = _task().split("train")[0]
    expression = problem.prompt.removesuffix("=")
    ids, labels = scripted_episode(tok, problem, call_tool=True)
    assert tok.decode(ids, skip_special_tokens=False) == (
        f"{problem.prompt}<calc>{expression}</calc><|eos|><result>{evaluate(expression)}</result>"
        f"{problem.answer}<|eos|>")
    trained = [i for i, label in enumerate(labels) if label != IGNORE]
    assert [ids[i] for i in trained] == [labels[i] for i in trained]
    # Exactly the two model turns (each ending in eos) carry loss; the prompt and the tool's result do not.
    text = tok.decode([ids[i] for i in trained], skip_special_tokens=False)
    assert text == f"<calc>{expression}</calc><|eos|>{problem.answer}<|eos|>"
    direct_ids, direct_labels = scripted_episode(tok, problem, call_tool=False)
    assert tok.decode(direct_ids, skip_special_tokens=False) == f"{problem.prompt}{problem.answer}<|eos|>"
    assert direct_labels[-1] == EOS_ID and direct_labels[: len(problem.prompt)] == [IGNORE] * len(problem.prompt)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_scripted_batches_split_by_kind_and_are_seeded(fraction):
    tok = build_char_tokenizer()
    problems = _task().split("train")[:64]
    first = scripted_batches(tok, problems, random.Random(3), fraction)
    again = scripted_batches(tok, problems, random.Random(3), fraction)
    assert all((a == c).all() and (b == d).all() for (a, b), (c, d) in zip(first, again, strict=True))
    assert sum(ids.shape[0] for ids, _ in first) == len(problems)
    calls = tok.encode("<calc>")
    with_call = [any(row[i:i + len(calls)].tolist() == calls for i in range(row.numel())) for ids, _ in first
                 for row in ids]
    # Each batch holds one kind, so it pads only to its own kind's length.
    assert len(first) == (1 if fraction in (0.0, 1.0) else 2)
    assert all(with_call) if fraction == 1.0 else (not any(with_call) if fraction == 0.0 else 0 < sum(with_call) < 64)


def test_warm_start_settings_are_valid():
    WARM_START.validate()
    with pytest.raises(ValueError, match="tool_fraction"):
        type(WARM_START)(tool_fraction=1.5).validate()


class _ScriptedPolicy(torch.nn.Module):
    """A 'model' whose greedy turn is a Python function of the episode so far (one-hot logits): pure
    logic, to check what the greedy check counts."""

    def __init__(self, tok, turn):
        super().__init__()
        self.tok, self.turn = tok, turn

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, len(self.tok))
        for row, ids in enumerate(input_ids.tolist()):
            text = self.tok.decode(ids, skip_special_tokens=False)
            prompt, _, after = text.partition("=")
            # What the model has written of its current turn: after its last eos and the observation.
            done = after.rsplit("<|eos|>", 1)[-1].rsplit("</result>", 1)[-1]
            # The intended turn, minus what of it the model has already written.
            intended = self.turn(prompt, after)
            nxt = intended[len(done)] if len(done) < len(intended) else None
            logits[row, -1, self.tok.encode(nxt)[0] if nxt else EOS_ID] = 1.0
        return type("Out", (), {"logits": logits})()


@pytest.mark.parametrize("name,turn,expected", [
    # Call the tool right, then copy its result: everything counts.
    ("calls", lambda prompt, after: (f"<calc>{prompt}</calc>" if "<result>" not in after
                                     else after.split("<result>")[1].split("</result>")[0]), (1.0, 1.0, 1.0)),
    # Call it with the wrong expression and copy that result: a call, not a correct one, and a wrong answer.
    ("wrong call", lambda prompt, after: (f"<calc>{prompt}+1</calc>" if "<result>" not in after
                                          else after.split("<result>")[1].split("</result>")[0]), (0.0, 1.0, 0.0)),
    # Answer directly with a number: no call, a wrong answer.
    ("direct", lambda prompt, after: "12345", (0.0, 0.0, 0.0)),
])
def test_the_greedy_check_counts_calls_correct_calls_and_answers(name, turn, expected):
    from recipes.tiny_tools.episodes import greedy_tool_use

    tok = build_char_tokenizer()
    problems = _task().split("heldout")[:4]
    report = greedy_tool_use(_ScriptedPolicy(tok, turn), tok, problems, max_turns=3, max_new_tokens=24,
                             max_episode_tokens=96)
    assert (report.accuracy, report.tool_call_rate, report.correct_tool_call_rate) == expected, name
    assert report.episodes == 4


def test_warm_start_is_deterministic_per_seed(tmp_path):
    """Two warm starts of one seed, concurrently (each pins one thread), write bitwise-identical weights."""
    import hashlib
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-m", "recipes.tiny_tools.prepare", "--out", str(tmp_path / name),
                               "--seed", "5", "--steps", "3", "--batch-size", "8", "--heldout-size", "4"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    infos = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        infos.append(json.loads(stdout.strip().splitlines()[-1]))
    digest = [hashlib.sha256((tmp_path / n / "model.safetensors").read_bytes()).hexdigest() for n in ("a", "b")]
    assert digest[0] == digest[1]
    strip = lambda info: {k: v for k, v in info.items() if k not in ("model_dir", "seconds")}  # noqa: E731
    assert strip(infos[0]) == strip(infos[1]) and infos[0]["warm_start_steps"] == 3 and infos[0]["heldout_size"] == 4
