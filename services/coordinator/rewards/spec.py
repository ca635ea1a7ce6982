"""The run spec's `reward` section (docs/rewards.md): where a step's rewards come from.

- `rule`: the task's own verifiable reward (the default, as before this section existed);
- `reward_model`: a sequence-classification model with one scalar head, served by scorer replicas;
- `judge`: a generative model reading a prompt template, whose verdict text is parsed into a score;
- `combination`: a weighted sum of the three, the weights as fields.

What the spec says is checked here, at submit; which scorer replicas exist is the operator's configuration
(the coordinator's scorer_addresses), checked by run_spec.confined_run_spec. Held-out evaluation always uses
the task's rule, whatever the training reward.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from contract.command_line import check_arg_value
from contract.engine_options import SGLANG_REWARD_MODEL_REFUSAL, EngineConfigError, check_engine_options
from contract.judge_template import MAX_TEMPLATE_CHARS, check_template
from services.common.float32_fields import Float32
from services.common.models.directory import check_model_dir
from services.common.path_roots import OutsideRoots, resolve_inside
from services.coordinator.spec_sections import MAX_PATH_LENGTH, StrictModel, field_error

MAX_PATTERN_CHARS = 512
MAX_SCORER_REPLICAS = 64
MODEL_KINDS = ("reward_model", "judge")


class ScoreRange(StrictModel):
    low: float = Field(..., description="Lowest score accepted (inclusive).")
    high: float = Field(..., description="Highest score accepted (inclusive).")

    @model_validator(mode="after")
    def _ordered(self) -> "ScoreRange":
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be finite and below high ({self.high})")
        return self


class VerdictParser(StrictModel):
    kind: Literal["regex", "json"] = Field(..., description="'regex': the first match of `pattern` in the "
                                           "verdict, its first group (or the whole match) read as a number. "
                                           "'json': the verdict's first JSON object, its `field` (a number).")
    pattern: str | None = Field(None, max_length=MAX_PATTERN_CHARS, description="kind 'regex': Python regular "
                                "expression, searched in the verdict text.")
    field: str | None = Field(None, min_length=1, max_length=128, description="kind 'json': the key holding "
                              "the score.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            compiled = re.compile(v)
        except re.error as exc:
            raise ValueError(f"does not compile: {exc}") from None
        if compiled.groups > 1:
            raise ValueError(f"has {compiled.groups} groups; use at most one (the score)")
        return v

    @model_validator(mode="after")
    def _one_way(self) -> "VerdictParser":
        needs, refuses = ("pattern", "field") if self.kind == "regex" else ("field", "pattern")
        if not getattr(self, needs):
            raise ValueError(f"{needs}: required by kind {self.kind!r}")
        if getattr(self, refuses) is not None:
            raise ValueError(f"{refuses}: not used by kind {self.kind!r}")
        return self


class ScorerSpec(StrictModel):
    model_path: str = Field(..., min_length=1, max_length=MAX_PATH_LENGTH, description="The scorer's model "
                            "directory, inside the coordinator's and scorer replicas' model_roots.")
    replicas: list[str] = Field(default_factory=list, max_length=MAX_SCORER_REPLICAS, description="host:port "
                                "of the scorer replicas serving it, each one of the coordinator's "
                                "scorer_addresses. Empty: every configured scorer replica (a combination of a "
                                "reward model and a judge must name disjoint replicas: one replica holds one "
                                "model).")
    engine: str = Field("", description="The engine the scorer replicas load the model with (each subclass "
                        "names those it accepts).")
    engine_options: dict = Field(default_factory=dict, description="Options of the scorer's engine, checked "
                                 "against its options model at submit (as LoadModel will).")

    @field_validator("engine_options")
    @classmethod
    def _engine_accepts(cls, v: dict, info: ValidationInfo) -> dict:
        engine = info.data.get("engine")
        if engine is None:  # a bad engine is reported on its own field
            return v
        try:
            check_engine_options(engine, json.dumps(v))
        except EngineConfigError as exc:
            raise ValueError("; ".join(f"{option or '(options)'}: {reason}" for option, reason in exc.fields)) \
                from None
        return v

    @field_validator("replicas")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("names a replica twice")
        return v


class RewardModelSpec(ScorerSpec):
    engine: Literal["reward_model"] = Field("reward_model", description="'reward_model': the scorer replica's "
                                            "embedded sequence-classification engine (services/rollout/scorer). "
                                            "'sglang' is refused, naming why (docs/rewards.md).")
    score_range: ScoreRange | None = Field(None, description="Scores outside it are refused (counted as "
                                           "out_of_range, never trained on). null: any finite score.")

    @field_validator("engine", mode="before")
    @classmethod
    def _not_sglang(cls, v: object) -> object:
        if v == "sglang":
            raise ValueError(SGLANG_REWARD_MODEL_REFUSAL)
        return v


class JudgeSpec(ScorerSpec):
    engine: Literal["torch", "sglang"] = Field("torch", description="'torch': the embedded engine's continuous "
                                               "scheduler decodes the verdicts; 'sglang': an SGLang server the "
                                               "scorer replica starts (or attaches to) from the operator's SGLang "
                                               "configuration, as a policy replica does. Either decodes greedily.")
    template: str = Field(..., min_length=1, max_length=MAX_TEMPLATE_CHARS, description="The judge's prompt: "
                          "{prompt}, {response} and {reference} are replaced by the item's texts; nothing else "
                          "is interpreted. Must contain {response}.")
    parser: VerdictParser = Field(..., description="How a score is read from the judge's verdict text.")
    score_range: ScoreRange = Field(..., description="A parsed score outside it is refused (out_of_range).")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="Verdict length cap in tokens (greedy decoding).")

    @field_validator("template")
    @classmethod
    def _renders(cls, v: str) -> str:
        return check_template(v)

    @model_validator(mode="after")
    def _sglang_model_path_fits_a_command_line(self) -> "JudgeSpec":
        # An SGLang scorer launches its server with --model-path=<this directory>: the path keeps the grammar of
        # every run-chosen command-line value, as RunSpec checks the policy's (contract/command_line.py).
        if self.engine == "sglang":
            try:
                check_arg_value(self.model_path, "model_path")
            except ValueError as exc:
                raise field_error("reward.judge.model_path", str(exc).removeprefix("model_path: ")) from None
        return self


class RewardWeights(StrictModel):
    rule: Float32 = Field(0.0, ge=-1000, le=1000, description="Weight of the task's rule reward.")
    reward_model: Float32 = Field(0.0, ge=-1000, le=1000, description="Weight of the reward model's score.")
    judge: Float32 = Field(0.0, ge=-1000, le=1000, description="Weight of the judge's score.")


class RewardSpec(StrictModel):
    kind: Literal["rule", "reward_model", "judge", "combination"] = Field(
        "rule", description="Where training rewards come from: the task's rule, a reward model, a judge, or a "
        "weighted combination (`weights`).")
    reward_model: RewardModelSpec | None = Field(None, description="kind reward_model (or a combination "
                                                 "weighting it): the sequence-classification scorer.")
    judge: JudgeSpec | None = Field(None, description="kind judge (or a combination weighting it): the "
                                    "generative scorer.")
    weights: RewardWeights | None = Field(None, description="kind combination: reward = sum of weight x score "
                                          "over the sources with a non-zero weight.")
    batch_size: int = Field(32, ge=1, le=4096, description="Items per Score call.")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Deadline of one Score call; a call past it "
                             "counts each of its items as a timeout and they are retried.")
    max_attempts: int = Field(3, ge=1, le=10, description="Score calls an item gets at most (on any live "
                              "scorer replica) before it is dropped from the step, counted by its last reason.")
    max_failed_fraction: float = Field(0.1, ge=0, le=1, description="A step whose dropped fraction of samples "
                                       "(unscored after max_attempts) exceeds this fails the run, naming the "
                                       "reasons.")
    cache_entries: int = Field(100_000, ge=0, le=10_000_000, description="Scores kept by (scorer weight digest, "
                               "template, prompt, response), so a retried or replayed step never asks again. "
                               "0: no cache.")

    @model_validator(mode="after")
    def _sources_present(self) -> "RewardSpec":
        used = self.sources()
        for source in MODEL_KINDS:
            if source in used and getattr(self, source) is None:
                raise field_error(f"reward.{source}", f"required by kind {self.kind!r}"
                                  + (f" with weights.{source} != 0" if self.kind == "combination" else ""))
            if source not in used and getattr(self, source) is not None:
                raise field_error(f"reward.{source}", f"set but not used by kind {self.kind!r}"
                                  + (f" (weights.{source} is 0)" if self.kind == "combination" else ""))
        if self.kind == "combination":
            if self.weights is None:
                raise field_error("reward.weights", "required by kind 'combination'")
            if not used:
                raise field_error("reward.weights", "every weight is 0")
        elif self.weights is not None:
            raise field_error("reward.weights", f"only for kind 'combination', not {self.kind!r}")
        if self.reward_model is not None and self.judge is not None:
            overlap = sorted(set(self.reward_model.replicas) & set(self.judge.replicas))
            if not (self.reward_model.replicas and self.judge.replicas) or overlap:
                raise field_error("reward.judge.replicas", "a reward model and a judge need disjoint, named "
                                  "scorer replicas (one replica holds one model)"
                                  + (f"; both name {overlap}" if overlap else ""))
        return self

    def sources(self) -> dict[str, float]:
        """{source: weight} of every source the reward sums."""
        if self.kind == "combination":
            weights = self.weights.model_dump() if self.weights is not None else {}
            return {k: float(w) for k, w in weights.items() if w != 0}
        return {self.kind: 1.0}

    def model_sources(self) -> list[str]:
        return [s for s in self.sources() if s in MODEL_KINDS]


def _scorer_model_refusal(kind: str, model_path: str) -> str | None:
    """Why a scorer's model_path is refused (not a model directory; a reward model without one scalar head)."""
    try:
        directory = check_model_dir(model_path)
        config = json.loads((directory / "config.json").read_text())
    except (FileNotFoundError, ValueError) as exc:
        return str(exc).removeprefix("model_path: ")
    except OSError as exc:
        return f"cannot read {model_path!r}: {exc.strerror}"
    if kind != "reward_model":
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not (isinstance(architectures, list) and architectures
            and all(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures)):
        return f"{model_path!r} is not a sequence-classification model (config.json architectures {architectures})"
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    if labels != 1:
        return f"{model_path!r} has {labels} labels; a reward model has one scalar head (num_labels 1)"
    return None


def reward_refusal(spec) -> tuple[str, str] | None:
    """(field, reason) of the first thing a RunSpec's `reward` cannot do, or None: a scorer model that is not
    one, a model reward for a run that has no sampled responses to score (kind sft) or whose environment
    rewards its episodes."""
    reward: RewardSpec = spec.reward
    if reward.kind == "rule":
        return None
    if spec.kind == "sft":
        return "reward.kind", f"{reward.kind!r} is refused with kind 'sft': a supervised run scores nothing"
    from services.coordinator.tasks import build_task
    from services.coordinator.tasks.episodic import EpisodicTask

    task = build_task(spec.task.name, spec.task.options)
    try:
        if isinstance(task, EpisodicTask):
            return "reward.kind", (f"{reward.kind!r}: task {spec.task.name!r} runs episodes, which its environment "
                                   "rewards; a scorer model cannot score them")
    finally:
        task.close()
    for source in reward.model_sources():
        refusal = _scorer_model_refusal(source, getattr(reward, source).model_path)
        if refusal is not None:
            return f"reward.{source}.model_path", refusal
    return None


def confine_reward(raw: object, model_roots: Sequence[str], scorer_addresses: Sequence[str]) -> object:
    """A submitted `reward` section with each scorer's model_path resolved inside `model_roots` and every
    replica it names one of `scorer_addresses` (the operator's fleet); field_error naming the field otherwise.
    Runs before the section's own checks, so a path outside the roots answers the same whether it exists."""
    if not isinstance(raw, dict):
        return raw  # the section's own type check reports it
    out = dict(raw)
    for source in MODEL_KINDS:
        section = raw.get(source)
        if not isinstance(section, dict):
            continue
        section = dict(section)
        if isinstance(section.get("model_path"), str):
            try:
                section["model_path"] = str(resolve_inside(section["model_path"], model_roots, "model_path"))
            except OutsideRoots as exc:
                raise field_error(f"reward.{source}.model_path", str(exc).removeprefix("model_path: ")) from None
        replicas = section.get("replicas")
        for i, address in enumerate(replicas if isinstance(replicas, list) else []):
            if address not in scorer_addresses:
                raise field_error(f"reward.{source}.replicas.{i}", f"{str(address)[:200]!r} is not one of the "
                                  f"coordinator's scorer replicas {list(scorer_addresses)}")
        out[source] = section
    kind = raw.get("kind", "rule")
    weights = raw.get("weights") if isinstance(raw.get("weights"), dict) else {}
    wants_scorer = kind in MODEL_KINDS or (kind == "combination" and any(weights.get(s) for s in MODEL_KINDS))
    if wants_scorer and not scorer_addresses:
        raise field_error("reward.kind", f"{kind!r} needs scorer replicas, and the coordinator has none "
                          "(its scorer_addresses)")
    return out
