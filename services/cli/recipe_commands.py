"""`lockstep recipe prepare|train|full-train|show NAME`: the shipped recipes, laid out, checked and submitted.

- prepare: says what to place where (model directory, JSONL files and the
  fields each line needs), creates those directories inside --models-dir and
  --data-dir, and checks what is there. It never downloads and writes nothing
  else. Exit 1 while anything is missing or malformed.
- train: the recipe's run spec with its paths filled in and --set applied,
  submitted through the REST API (with the deployment's token); --dry-run (or
  `show`) prints that spec and the launch commands instead.
- full-train: prepare, then train only when every check passed.

The text each command prints is what the snapshot tests pin
(tests/recipes/snapshots/).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.cli.client import CoordinatorClient, parse_set_pairs
from services.cli.recipe_launch import render_launch
from services.cli.recipe_layout import (
    Finding,
    Recipe,
    check_layout,
    find_recipe,
    lay_out,
    parse_start_from,
    resolve_spec,
    sft_spec,
    task_fields,
)
from services.common.platform import Platform

RECIPES_ROOT = Path(__file__).resolve().parents[2] / "recipes"
WEIGHT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors (or model.safetensors.index.json and every shard it lists)")


def add_recipe_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("recipe", help="Prepare, submit or show one of the shipped recipes (recipes/<name>/).")
    actions = r.add_subparsers(dest="action", required=True)
    for action, help_text in (
        ("prepare", "Say what to place where, create those directories, check what is there (never downloads)."),
        ("train", "Submit the recipe with its paths filled in (--dry-run: print the spec and launch commands)."),
        ("full-train", "prepare, then train once every check passes."),
        ("show", "Print the resolved run spec and the launch commands (train --dry-run)."),
    ):
        a = actions.add_parser(action, help=help_text)
        a.add_argument("name", help="Recipe directory under --recipes-dir (e.g. qwen3_4b_lora_grpo).")
        a.add_argument("--recipes-dir", type=Path, default=RECIPES_ROOT,
                       help="Directory of recipe directories (each with recipe.yaml and layout.yaml); default: "
                            "this checkout's recipes/.")
        a.add_argument("--models-dir", required=True, type=Path,
                       help="Directory holding model directories (prepare checks it; created if absent).")
        a.add_argument("--data-dir", required=True, type=Path,
                       help="Directory holding the recipe's JSONL files (prepare checks it; created if absent).")
        a.add_argument("--served-models-dir", default="",
                       help="--models-dir as the services see it (compose: /models); default: --models-dir.")
        a.add_argument("--served-data-dir", default="",
                       help="--data-dir as the services see it (compose: a directory under /models or /runs); "
                            "default: --data-dir.")
        a.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                       help="Override a spec field after the paths are filled in (dotted, value as JSON).")
        a.add_argument("--platform", choices=[p.value for p in Platform], default="",
                       help="Platform the launch commands are printed for; default: the recipe's layout.yaml.")
        a.add_argument("--trainer-gpus", default="", help="Host GPU indices of the trainer (compose).")
        a.add_argument("--rollout-gpus", default="", help="Host GPU indices of the rollout (compose).")
        if action in ("train", "show"):
            a.add_argument("--start-from", default="", metavar="RUN[:STEP]",
                           help="Start from that run's checkpoint (its last, or STEP's) instead of the layout's "
                                "model: SFT, then RL, then distillation. The data files are as prepare found them.")
        if action in ("train", "full-train"):
            a.add_argument("--dry-run", action="store_true", help="Print the spec and launch commands; submit nothing.")
            a.add_argument("--watch", action="store_true", help="Show live progress until the run ends.")


@dataclass(frozen=True)
class RecipeRequest:
    """One `lockstep recipe ...` invocation, its paths made absolute."""

    action: str
    recipe: Recipe
    models_dir: Path
    data_dir: Path
    served_models_dir: str
    served_data_dir: str
    overrides: dict
    platform: Platform
    trainer_gpus: str
    rollout_gpus: str
    dry_run: bool
    start_from: dict | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RecipeRequest":
        recipe = find_recipe(args.name, args.recipes_dir)
        models_dir, data_dir = args.models_dir.resolve(), args.data_dir.resolve()
        launch = recipe.layout.launch
        return cls(
            action=args.action, recipe=recipe, models_dir=models_dir, data_dir=data_dir,
            served_models_dir=args.served_models_dir or str(models_dir),
            served_data_dir=args.served_data_dir or str(data_dir),
            overrides=parse_set_pairs(args.set),
            platform=Platform(args.platform or launch.platform),
            trainer_gpus=args.trainer_gpus or launch.trainer_gpus,
            rollout_gpus=args.rollout_gpus or launch.rollout_gpus,
            dry_run=args.action == "show" or getattr(args, "dry_run", False),
            start_from=parse_start_from(args.start_from) if getattr(args, "start_from", "") else None,
        )

    def spec(self) -> dict:
        return resolve_spec(self.recipe, models_dir=self.served_models_dir, data_dir=self.served_data_dir,
                            overrides=self.overrides, start_from=self.start_from)


def placement_text(request: RecipeRequest, spec: dict) -> str:
    """What goes where: the model directories and every JSONL file with the fields its lines need."""
    layout = request.recipe.layout
    fields, marker = task_fields(spec)
    out = [f"reproduces: {layout.reproduces}",
           "nothing is downloaded: place these files (from the sources named), then run prepare again",
           f"model  {request.models_dir / layout.model.dir}/  (from {layout.model.source})",
           "       " + ", ".join(WEIGHT_FILES)]
    if layout.teacher is not None:
        out += [f"teacher {request.models_dir / layout.teacher.dir}/  -> teacher.model_path  "
                f"(from {layout.teacher.source})",
                "       the same files; its tokenizer must be the model's, token for token (checked at submit)"]
    line = ("one JSON object per line with non-empty string fields " + ", ".join(repr(f) for f in fields)
            + (f" (the answer after the last {marker!r})" if marker else ""))
    for item in layout.data:
        out.append(f"data   {request.data_dir / item.file}  -> {item.spec_field}  (from {item.source})")
        out.append(f"       {sft_line(spec) if item.checked_as == 'sft' else line}")
        if item.note:
            out.append(f"       {item.note}")
    return "\n".join(out) + "\n"


def sft_line(spec: dict) -> str:
    """What each line of the recipe's SFT dataset holds, in the field names its `sft` section gives."""
    try:
        config = sft_spec(spec, Path("unused"))
    except ValueError as exc:
        return f"(cannot say: {exc})"
    return (f"one JSON object per line: {config.messages_field!r}, a list of {{'role': system|user|assistant, "
            f"'content': string}} with an assistant turn (the loss covers those), or string fields "
            f"{config.prompt_field!r} and {config.completion_field!r} (the loss covers the completion)")


def findings_text(created: list[Path], findings: list[Finding]) -> str:
    out = ["created directories: " + (", ".join(str(d) for d in created) or "none (all there)"), "checks:"]
    out += [f"  {'ok  ' if f.ok else 'FAIL'} {f.path}: {f.detail}" for f in findings]
    bad = sum(not f.ok for f in findings)
    out.append(f"result: {'ready' if not bad else f'{bad} of {len(findings)} checks failed'}")
    return "\n".join(out) + "\n"


def prepare(request: RecipeRequest, spec: dict) -> tuple[str, bool]:
    """(what prepare prints, whether everything is in place)."""
    created = lay_out(request.recipe, models_dir=request.models_dir, data_dir=request.data_dir)
    findings = check_layout(request.recipe, spec, models_dir=request.models_dir, data_dir=request.data_dir)
    text = f"# lockstep recipe prepare {request.recipe.name}\n" + placement_text(request, spec)
    return text + findings_text(created, findings), all(f.ok for f in findings)


def dry_run_text(request: RecipeRequest, spec: dict) -> str:
    """The resolved spec (as POST /v1/runs receives it) and the launch commands."""
    return (f"# lockstep recipe train {request.recipe.name} --dry-run\n"
            "## run spec (POST /v1/runs)\n" + json.dumps(spec, indent=2) + "\n"
            + render_launch(spec, request.platform, models_dir=str(request.models_dir),
                            served_models_dir=request.served_models_dir,
                            trainer_gpus=request.trainer_gpus, rollout_gpus=request.rollout_gpus))


def run_recipe(request: RecipeRequest, emit: Callable[[str], None],
               client_factory: Callable[[], CoordinatorClient],
               watch: Callable[[CoordinatorClient, str], int] | None = None) -> int:
    """Run one recipe action; `emit` prints, `client_factory` opens the REST client only when one is needed."""
    spec = request.spec()
    if request.action in ("prepare", "full-train"):
        text, ready = prepare(request, spec)
        emit(text)
        if request.action == "prepare":
            return 0 if ready else 1
        if not ready:
            emit("full-train: not submitting until prepare's checks pass\n")
            return 1
    if request.dry_run:
        emit(dry_run_text(request, spec))
        return 0
    client = client_factory()
    try:
        run = client.submit(spec)
        emit(f"submitted run {run['id']} ({run['name']})\n")
        return watch(client, run["id"]) if watch is not None else 0
    finally:
        client.close()
