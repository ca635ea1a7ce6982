"""A recipe directory: its run spec, the local files it needs, and the checks `lockstep recipe prepare` makes.

`recipes/<name>/recipe.yaml` is a run spec; `recipes/<name>/layout.yaml` says
which of its fields are local paths and what must be found there: the model
directory (and a distillation teacher's) under the models directory, and
JSONL files under the data directory: a task's problems, or an SFT dataset
checked with the SFT reader's own row checks (contract/data/sft_dataset.py).
Nothing is downloaded (there is no model hub on the nodes): the checks say
exactly what is missing and where it goes.

Everything here is pure except the file checks, which only read, and
`lay_out`, which creates the directories the layout names and nothing else.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from contract.data.math_options import MAX_DATASET_LINES, MathConfig, reference_answer
from contract.data.sft_dataset import SftSpec, read_sft_rows
from services.cli.client import apply_overrides, load_recipe

RECIPE_FILE = "recipe.yaml"
LAYOUT_FILE = "layout.yaml"
RECIPE_NAME = re.compile(r"^[a-z0-9][a-z0-9_]*$")
TASKS_WITH_DATA = ("math",)
"""Tasks whose problems come from files the layout names (arithmetic generates its own)."""
SFT_PATH_FIELD = "sft.path"
"""The run-spec field an SFT dataset fills (the `sft` section's other fields say what its lines hold)."""
TEACHER_PATH_FIELD = "teacher.model_path"
"""The run-spec field a distillation teacher's directory fills."""


def _relative_inside(value: str) -> str:
    """A path relative to a directory it must stay inside: no absolute path, no `..`."""
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(f"must be a relative path inside its directory, got {value!r}")
    return str(p)


class ModelPlacement(BaseModel):
    """Where one of the recipe's models (the student, or a distillation teacher) goes under the models directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: str = Field(..., description="Model directory, relative to the models directory.")
    source: str = Field(..., min_length=1, description="Where to get it (printed for the operator; never fetched).")

    @field_validator("dir")
    @classmethod
    def _inside_models_dir(cls, v: str) -> str:
        return _relative_inside(v)


class DataPlacement(BaseModel):
    """One JSONL file of problems under the data directory, and the run-spec field that names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(..., description="JSONL file, relative to the data directory.")
    spec_field: str = Field(..., pattern=r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$",
                            description="Dotted run-spec field set to the file's path (a number indexes a list: "
                            "eval.sets.0.path). It must already exist in recipe.yaml.")
    source: str = Field(..., min_length=1, description="Where to get it (printed; never fetched).")
    note: str = Field("", description="How to turn the source into the fields the task reads, if it differs.")
    checked_as: Literal["task", "sft"] = Field(
        "task", description="'task': problems, every line with the fields the run's task reads. 'sft': the "
        "dataset of a kind 'sft' run (spec_field sft.path), every line checked as the coordinator's SFT reader "
        "checks it, with the fields the recipe's `sft` section names.")

    @field_validator("file")
    @classmethod
    def _inside_data_dir(cls, v: str) -> str:
        return _relative_inside(v)

    @model_validator(mode="after")
    def _sft_fills_its_path(self) -> "DataPlacement":
        if (self.checked_as == "sft") != (self.spec_field == SFT_PATH_FIELD):
            raise ValueError(f"checked_as 'sft' goes with spec_field {SFT_PATH_FIELD!r} and only with it "
                             f"(got checked_as {self.checked_as!r}, spec_field {self.spec_field!r})")
        return self


class LaunchDefaults(BaseModel):
    """What the printed launch commands assume unless the command line says otherwise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    platform: str = Field("rocm", pattern=r"^(rocm|cuda|cpu)$",
                          description="Platform the compose command and SGLang flags are printed for.")
    trainer_gpus: str = Field("0", pattern=r"^[0-9]+(,[0-9]+)*$", description="Host GPU indices of the trainer.")
    rollout_gpus: str = Field("1", pattern=r"^[0-9]+(,[0-9]+)*$", description="Host GPU indices of the rollout.")


class RecipeLayout(BaseModel):
    """recipes/<name>/layout.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reproduces: str = Field(..., min_length=1, description="One line: what the recipe reproduces.")
    model: ModelPlacement = Field(..., description="The trained model's directory (fills model_path).")
    teacher: ModelPlacement | None = Field(None, description="An on-policy distillation teacher's directory "
                                           f"(fills {TEACHER_PATH_FIELD}, which recipe.yaml must have); none "
                                           "without a teacher.")
    data: list[DataPlacement] = Field(default_factory=list, description="Every JSONL file the run reads.")

    @model_validator(mode="after")
    def _teacher_beside_the_model(self) -> "RecipeLayout":
        if self.teacher is not None and self.teacher.dir == self.model.dir:
            raise ValueError(f"teacher.dir: {self.teacher.dir!r} is the model's own directory")
        return self
    launch: LaunchDefaults = Field(default_factory=LaunchDefaults)


@dataclass(frozen=True)
class Recipe:
    name: str
    directory: Path
    layout: RecipeLayout


def find_recipe(name: str, recipes_root: Path) -> Recipe:
    """The recipe `name` under `recipes_root`; ValueError names what is wrong and which recipes exist."""
    known = sorted(p.parent.name for p in recipes_root.glob(f"*/{LAYOUT_FILE}"))
    if not RECIPE_NAME.match(name) or not (recipes_root / name / LAYOUT_FILE).is_file():
        raise ValueError(f"recipe {name!r}: no {recipes_root / name / LAYOUT_FILE}; recipes with a layout: {known}")
    directory = recipes_root / name
    text = (directory / LAYOUT_FILE).read_text()
    try:
        layout = RecipeLayout.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        raise ValueError(f"{directory / LAYOUT_FILE}: {_errors(exc)}") from None
    return Recipe(name=name, directory=directory, layout=layout)


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(file)'}: {e['msg']}" for e in exc.errors())


def set_existing_field(spec: dict, dotted: str, value: object) -> None:
    """Set `dotted` (a number indexes a list) to `value`; the field must already be there, so a layout that
    names a field the recipe lacks is an error, never a new key the API then refuses far from its cause."""
    parts = dotted.split(".")
    node: object = spec
    for i, part in enumerate(parts):
        where = ".".join(parts[:i + 1])
        last = i == len(parts) - 1
        if isinstance(node, dict):
            if part not in node:
                raise ValueError(f"{dotted}: the recipe has no field {where}")
            if last:
                node[part] = value
            else:
                node = node[part]
        elif isinstance(node, list) and part.isdigit():
            index = int(part)
            if index >= len(node):
                raise ValueError(f"{dotted}: {'.'.join(parts[:i])} has {len(node)} entries, no [{index}]")
            if last:
                node[index] = value
            else:
                node = node[index]
        else:
            raise ValueError(f"{dotted}: {'.'.join(parts[:i]) or '(spec)'} is {type(node).__name__}, not a mapping")


def parse_start_from(text: str) -> dict:
    """`RUN` or `RUN:STEP` (a run id, its checkpoint of that step) as the run spec's `start_from`."""
    run, _, step = text.partition(":")
    if not run or (step and not step.isdigit()) or int(step or 1) < 1:
        raise ValueError(f"--start-from: {text!r} is not RUN or RUN:STEP (a run id, a step >= 1)")
    return {"run": run, "step": int(step)} if step else {"run": run}


def resolve_spec(recipe: Recipe, *, models_dir: str, data_dir: str, overrides: dict,
                 start_from: dict | None = None) -> dict:
    """The run spec to submit: recipe.yaml with the layout's paths under the directories the services see,
    then the --set overrides (last, so they can change anything). With `start_from` the run starts from
    another run's checkpoint instead of the layout's model (the coordinator refuses both at once)."""
    spec = load_recipe(recipe.directory / RECIPE_FILE)
    set_existing_field(spec, "model_path", str(PurePosixPath(models_dir) / recipe.layout.model.dir))
    if recipe.layout.teacher is not None:
        set_existing_field(spec, TEACHER_PATH_FIELD, str(PurePosixPath(models_dir) / recipe.layout.teacher.dir))
    for item in recipe.layout.data:
        set_existing_field(spec, item.spec_field, str(PurePosixPath(data_dir) / item.file))
    if start_from is not None:
        del spec["model_path"]
        spec["start_from"] = start_from
    return apply_overrides(spec, overrides)


def task_fields(spec: dict) -> tuple[tuple[str, ...], str]:
    """(fields every JSONL line needs, the answer marker) for the spec's task, as the task itself reads them."""
    task = spec.get("task") or {}
    if task.get("name") not in TASKS_WITH_DATA:
        return (), ""
    options = {k: v for k, v in (task.get("options") or {}).items() if k in MathConfig.model_fields}
    try:
        config = MathConfig.model_validate(options)
    except ValidationError as exc:
        raise ValueError(f"task.options: {_errors(exc)}") from None
    if config.dataset.messages_field:  # a chat instead of a question: the coordinator checks its messages
        return (config.answer_field,), config.answer_marker
    return (config.question_field, config.answer_field), config.answer_marker


# ------------------------------------------------------------------ checks --

@dataclass(frozen=True)
class Finding:
    """One thing prepare looked at: `ok`, or what is wrong with it."""

    path: Path
    ok: bool
    detail: str


def check_model(path: Path) -> list[Finding]:
    """A Hugging Face causal-LM directory: config.json (a JSON object naming model_type), a tokenizer, and
    safetensors weights (one file, or an index whose every shard is there)."""
    if not path.is_dir():
        return [Finding(path, False, "missing: a Hugging Face model directory goes here")]
    out: list[Finding] = []
    config = path / "config.json"
    try:
        parsed = json.loads(config.read_text())
        if not isinstance(parsed, dict) or not isinstance(parsed.get("model_type"), str):
            out.append(Finding(config, False, "is not a JSON object with a model_type"))
        else:
            out.append(Finding(config, True, f"model_type {parsed['model_type']}"))
    except FileNotFoundError:
        out.append(Finding(config, False, "missing"))
    except (OSError, ValueError) as exc:
        out.append(Finding(config, False, f"does not parse: {exc}"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = path / name
        out.append(Finding(f, f.is_file(), "present" if f.is_file() else "missing"))
    out.append(_check_weights(path))
    return out


def _check_weights(path: Path) -> Finding:
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return Finding(single, True, "present")
    if not index.is_file():
        return Finding(single, False, "missing: model.safetensors, or model.safetensors.index.json and its shards")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return Finding(index, False, f"does not parse as a safetensors index: {exc}")
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        return Finding(index, False, f"{len(missing)} of {len(shards)} shards missing, first {missing[0]}")
    return Finding(index, True, f"{len(shards)} shards present")


def check_jsonl(path: Path, fields: tuple[str, ...], marker: str) -> Finding:
    """Every line a JSON object whose `fields` are non-empty strings (the answer containing `marker` when the
    task cuts the answer at one). Stops at the first bad line and names it."""
    if not path.is_file():
        return Finding(path, False, "missing")
    answer_field = fields[-1] if fields else ""
    count = 0
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                count += 1
                if count > MAX_DATASET_LINES:
                    return Finding(path, False, f"more than {MAX_DATASET_LINES} problems (the task's limit)")
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    return Finding(path, False, f"line {number}: not JSON ({exc})")
                if not isinstance(row, dict):
                    return Finding(path, False, f"line {number}: a JSON {type(row).__name__}, not an object")
                for name in fields:
                    if not isinstance(row.get(name), str) or not row[name].strip():
                        return Finding(path, False, f"line {number}: field {name!r} missing or not a non-empty "
                                       f"string (has {sorted(row)})")
                if answer_field:
                    try:
                        reference_answer(row[answer_field], marker)
                    except ValueError as exc:
                        return Finding(path, False, f"line {number}: field {answer_field!r} {exc}")
    except (OSError, UnicodeDecodeError) as exc:
        return Finding(path, False, f"cannot read: {exc}")
    if count == 0:
        return Finding(path, False, "no problems in it")
    return Finding(path, True, f"{count} problems with {', '.join(repr(f) for f in fields)}")


def sft_spec(spec: dict, path: Path) -> SftSpec:
    """The recipe's `sft` section as the run spec validates it, reading `path` (the file as prepare sees it);
    ValueError naming the field."""
    section = spec.get("sft")
    if not isinstance(section, dict):
        raise ValueError("sft: the recipe has no `sft` section, so the dataset's fields are unknown")
    try:
        return SftSpec.model_validate({**section, "path": str(path)})
    except ValidationError as exc:
        raise ValueError(f"sft.{_errors(exc)}") from None


def check_sft(path: Path, spec: dict) -> Finding:
    """An SFT dataset, every line read and its fields checked by the coordinator's own row checks
    (contract.data.sft_dataset.read_sft_rows); tokenizing, the chat template and the length limit are the
    coordinator's at submit, which needs the model."""
    if not path.is_file():
        return Finding(path, False, "missing")
    try:
        config = sft_spec(spec, path)
        rows = read_sft_rows(config)
    except (ValueError, OSError, RuntimeError) as exc:
        return Finding(path, False, str(exc).replace(f"{path} ", "", 1))
    if rows[0].messages is not None:
        return Finding(path, True, f"{len(rows)} conversations in {config.messages_field!r}")
    return Finding(path, True, f"{len(rows)} pairs in {config.prompt_field!r} -> {config.completion_field!r}")


def lay_out(recipe: Recipe, *, models_dir: Path, data_dir: Path) -> list[Path]:
    """Create the directories the layout names (the model directories' parents and every JSONL's directory),
    inside the two given directories; nothing else is written. Returns those it created."""
    wanted = [(models_dir / recipe.layout.model.dir).parent]
    if recipe.layout.teacher is not None:
        wanted.append((models_dir / recipe.layout.teacher.dir).parent)
    wanted += [(data_dir / item.file).parent for item in recipe.layout.data]
    created = []
    for d in dict.fromkeys(wanted):
        if not d.is_dir():
            d.mkdir(parents=True, exist_ok=True)
            created.append(d)
    return created


def check_layout(recipe: Recipe, spec: dict, *, models_dir: Path, data_dir: Path) -> list[Finding]:
    """What prepare checks: the model directory (and the teacher's), then every JSONL file: problems with the
    fields the task reads, an SFT dataset as the SFT reader reads it."""
    fields, marker = task_fields(spec)
    findings = check_model(models_dir / recipe.layout.model.dir)
    if recipe.layout.teacher is not None:
        findings += check_model(models_dir / recipe.layout.teacher.dir)
    findings += [check_sft(data_dir / item.file, spec) if item.checked_as == "sft"
                 else check_jsonl(data_dir / item.file, fields, marker) for item in recipe.layout.data]
    return findings
