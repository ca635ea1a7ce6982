"""Calculator episodes in-process: the warm start's scripted episodes, and a greedy held-out check.

Both follow the rollout's episode layout (services/rollout/episodes/runner.py with the plain codec of a model
without a chat template): prompt tokens, then each model turn's tokens ending with eos, then the
observation's tokens, encoded as plain text. The greedy check runs the real `calculator` environment
(services/environments/calculator.py) in this process, and reports what the run's eval does not: how often the
policy calls the tool, and how often the call computes the problem's product.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.environment import EpisodeProblem
from recipes.char_tokenizer import EOS_ID, PAD_ID
from services.coordinator.tasks.base import Problem
from services.environments.calculator import CalculatorEnvironment, CalculatorOptions, evaluate

IGNORE = -100  # cross_entropy's ignore_index: prompt, observation and padding positions carry no loss


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def scripted_episode(tokenizer, problem: Problem, *, call_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one scripted episode; labels are IGNORE except on the model's tokens.

    With the tool: `<calc>a*b</calc>` eos, `<result>N</result>` (environment), `N` eos. Without: `N` eos.
    """
    ids = _encode(tokenizer, problem.prompt)
    labels = [IGNORE] * len(ids)

    def model(text: str) -> None:
        toks = _encode(tokenizer, text) + [EOS_ID]
        ids.extend(toks)
        labels.extend(toks)

    if call_tool:
        expression = problem.prompt.removesuffix("=")
        model(f"<calc>{expression}</calc>")
        observation = _encode(tokenizer, f"<result>{evaluate(expression)}</result>")
        ids.extend(observation)
        labels.extend([IGNORE] * len(observation))
    model(problem.answer)
    return ids, labels


def scripted_batches(tokenizer, problems: Sequence[Problem], rng: random.Random,
                     tool_fraction: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One optimizer step's scripted episodes as right-padded (ids, labels) batches, one batch per
    episode kind (tool-calling episodes are ~4x longer than direct answers, so padding them together
    would make most of a mixed batch padding). Labels[t] is the token at t; the loss shifts them."""
    kinds: dict[bool, list[tuple[list[int], list[int]]]] = {}
    for p in problems:
        call = rng.random() < tool_fraction
        kinds.setdefault(call, []).append(scripted_episode(tokenizer, p, call_tool=call))
    out = []
    for _, rows in sorted(kinds.items()):
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
        lab = torch.full((len(rows), width), IGNORE, dtype=torch.long)
        for i, (r, l) in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            lab[i, : len(l)] = torch.tensor(l)
        out.append((ids, lab))
    return out


@dataclass(frozen=True)
class ToolUseReport:
    """Greedy episodes over a problem set."""

    accuracy: float
    """Episodes whose reward is the environment's full reward (the right product)."""
    tool_call_rate: float
    """Episodes with at least one tool call."""
    correct_tool_call_rate: float
    """Episodes with a tool call whose expression evaluates to the problem's answer."""
    episodes: int

    def as_dict(self, prefix: str = "") -> dict:
        return {f"{prefix}accuracy": self.accuracy, f"{prefix}tool_call_rate": self.tool_call_rate,
                f"{prefix}correct_tool_call_rate": self.correct_tool_call_rate}


@torch.no_grad()
def _greedy_turns(model, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each context's greedy turn, up to and including eos. Contexts of one length decode together,
    unpadded, so a turn cannot depend on which other contexts share its batch."""
    out: list[list[int]] = [[] for _ in contexts]
    by_len: dict[int, list[int]] = {}
    for i, c in enumerate(contexts):
        by_len.setdefault(len(c), []).append(i)
    for _, idx in sorted(by_len.items()):
        ids = torch.tensor([contexts[i] for i in idx], dtype=torch.long)
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_new_tokens):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
            for j, i in enumerate(idx):
                if not done[j]:
                    out[i].append(int(nxt[j]))
            done |= nxt == EOS_ID
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def greedy_tool_use(model, tokenizer, problems: Sequence[Problem], *, max_turns: int, max_new_tokens: int,
                    max_episode_tokens: int) -> ToolUseReport:
    """Play each problem's episode greedily against the calculator environment, in this process."""
    was_training = model.training
    model.eval()
    envs = [CalculatorEnvironment(CalculatorOptions()) for _ in problems]
    contexts = [_encode(tokenizer, env.reset(EpisodeProblem(p.problem_id, p.prompt, p.answer)))
                for env, p in zip(envs, problems)]
    rewards = [0.0] * len(problems)
    called = [False] * len(problems)
    called_right = [False] * len(problems)
    live = list(range(len(problems)))
    for _ in range(max_turns):
        if not live:
            break
        rooms = {i: min(max_new_tokens, max_episode_tokens - len(contexts[i])) for i in live}
        live = [i for i in live if rooms[i] > 0]
        turns: dict[int, list[int]] = {}
        for room in sorted(set(rooms[i] for i in live)):
            members = [i for i in live if rooms[i] == room]
            for i, t in zip(members, _greedy_turns(model, [contexts[i] for i in members], room)):
                turns[i] = t
        still = []
        for i in live:
            contexts[i] = contexts[i] + turns[i]
            text = tokenizer.decode(turns[i], skip_special_tokens=True)
            result = envs[i].step(text)
            if result.tool_call:
                called[i] = True
                # A call is right when the environment's answer to it is the problem's answer.
                called_right[i] |= result.observation == f"<result>{problems[i].answer}</result>"
            rewards[i] += result.reward
            if not result.done:
                contexts[i] = contexts[i] + _encode(tokenizer, result.observation)
                if len(contexts[i]) < max_episode_tokens:
                    still.append(i)
        live = still
    model.train(was_training)
    n = max(len(problems), 1)
    return ToolUseReport(sum(r >= 1.0 for r in rewards) / n, sum(called) / n, sum(called_right) / n, len(problems))
