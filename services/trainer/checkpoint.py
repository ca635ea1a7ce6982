"""Trainer checkpoints in Hugging Face layout, plus what resuming a run needs.

A checkpoint directory is a normal model directory — config.json,
model.safetensors holding the float32 master weights (tied aliases once),
generation config and the tokenizer files copied from the run's model — so
AutoModelForCausalLM (with any dtype), AutoTokenizer and SGLang load it as is;
loading it in bf16 gives exactly the tensors rollout was sent. Beside those:
- optimizer.pt: the whole AdamW state keyed by parameter name (float32;
  tensors and plain numbers only, so it loads with torch.load(weights_only=True)),
  independent of how many ranks the optimizer was sharded over;
- lockstep_trainer_state.json: run id, policy version, seed, the run's model
  path and trainer config, and the recorded metrics of every applied step (so
  a replayed TrainStep after a restart still answers with the real numbers)
  with the digest of the trajectories it was trained on (so such a replay is
  still checked against them; absent in checkpoints written before).

A LoRA run's checkpoint holds the adapters alone, in peft's layout
(adapter_config.json naming the base model, adapter_model.safetensors with the
float32 adapter masters under peft's saved keys), so
`PeftModel.from_pretrained(base, directory)` loads it; beside them the
adapters' optimizer state, the trainer state and the tokenizer files. The base
is the run's model_path, which a resume loads again.

The directory is written under a fresh temporary sibling and renamed into
place, and the state file is written last: a directory without it is not a
checkpoint. A write that fails (a full disk, say) removes the temporary sibling
and leaves the target as it was. An existing directory is replaced only if it
is a checkpoint of the same run; the trainer never deletes a directory the run
did not create.

`save_run` and `read_run` / `restore_run` are a configured run's checkpoint:
what the trainer gathers from its shards to write one, and what it validates
(every name, shape and dtype, before the first copy) and loads back.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.models.weight_files import SAFETENSORS_INDEX, load_failure, weight_files
from services.trainer.distributed import sharding
from services.trainer.model import lora
from services.trainer.run_state import RunState

STATE_FILE = "lockstep_trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
STATE_FORMAT = 2  # 2: float32 masters and a name-keyed optimizer state

# Tokenizer files Hugging Face tokenizers write; copied so the checkpoint is a
# complete model directory. Weights, configs and our own files are not copied.
_TOKENIZER_NAMES = {
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.json", "spiece.model",
}


@dataclass(frozen=True)
class TrainerState:
    """Everything besides weights and optimizer state that a resume restores."""

    run_id: str
    policy_version: int
    seed: int
    model_path: str
    trainer_config_json: str
    step_metrics: dict[int, dict[str, float]]
    step_digests: dict[int, str] = field(default_factory=dict)

    @staticmethod
    def of_run(run: RunState) -> TrainerState:
        return TrainerState(
            run_id=run.run_id,
            policy_version=run.policy_version,
            seed=run.seed,
            model_path=run.model_path,
            trainer_config_json=run.config.model_dump_json(),
            step_metrics=dict(run.step_metrics),
            step_digests=dict(run.step_digests),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": STATE_FORMAT,
                "run_id": self.run_id,
                "policy_version": self.policy_version,
                "seed": self.seed,
                "model_path": self.model_path,
                "trainer_config_json": self.trainer_config_json,
                "step_metrics": {str(k): v for k, v in sorted(self.step_metrics.items())},
                "step_digests": {str(k): v for k, v in sorted(self.step_digests.items())},
            },
            indent=1,
        )

    @staticmethod
    def from_json(text: str, *, where: str) -> TrainerState:
        try:
            d = json.loads(text)
            if d.get("format") != STATE_FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {STATE_FORMAT}")
            return TrainerState(
                run_id=str(d["run_id"]),
                policy_version=int(d["policy_version"]),
                seed=int(d["seed"]),
                model_path=str(d["model_path"]),
                trainer_config_json=str(d["trainer_config_json"]),
                step_metrics={int(k): {m: float(x) for m, x in v.items()} for k, v in d["step_metrics"].items()},
                step_digests={int(k): _digest(v) for k, v in d.get("step_digests", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}: unreadable trainer state ({exc})") from None


def _digest(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"step_digests: {value!r} is not a sha256 hex digest")
    return value


def is_tokenizer_file(name: str) -> bool:
    return name in _TOKENIZER_NAMES or name.startswith("tokenizer") or name.endswith(".jinja")


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and is_tokenizer_file(f.name):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


class ForeignDirectory(ValueError):
    """A checkpoint target that exists and is not a checkpoint of this run: never replaced."""


def check_replaceable(target: Path, run_id: str) -> None:
    """A directory may be replaced only if it is a checkpoint of `run_id`; ForeignDirectory otherwise."""
    if target.is_symlink() or not target.is_dir():
        raise ForeignDirectory(f"directory: {target} exists and is not a directory this run created; not replaced")
    try:
        owner = read_state(target).run_id
    except (FileNotFoundError, ValueError):
        owner = None
    if owner != run_id:
        what = "a checkpoint of another run" if owner is not None else "not a Lockstep checkpoint"
        raise ForeignDirectory(f"directory: {target} exists and is {what}; a checkpoint of run {run_id!r} "
                               "replaces only its own checkpoints")


def save_checkpoint(
    directory: str | Path,
    *,
    lm: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    compute_dtype: torch.dtype,
    optimizer_state: dict,
    state: TrainerState,
    tokenizer_dir: str | Path | None,
) -> Path:
    """Write the checkpoint into a fresh temporary sibling, then move it into place.

    An existing `directory` is replaced only when it is a checkpoint of the same run (a re-saved step);
    anything else there is refused (ForeignDirectory) and left untouched."""
    return _save_atomically(directory, lambda tmp: write_model_dir(tmp, lm, weights, compute_dtype),
                            optimizer_state=optimizer_state, state=state, tokenizer_dir=tokenizer_dir)


def save_adapter_checkpoint(
    directory: str | Path,
    *,
    adapter_config,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    state: TrainerState,
    tokenizer_dir: str | Path | None,
) -> Path:
    """A LoRA checkpoint: `adapter_config` (peft's LoraConfig) and the adapters' float32 masters under
    peft's saved keys, written and replaced like `save_checkpoint`."""
    return _save_atomically(directory, lambda tmp: write_adapter_dir(tmp, adapter_config, weights),
                            optimizer_state=optimizer_state, state=state, tokenizer_dir=tokenizer_dir)


def write_adapter_dir(directory: Path, adapter_config, weights: dict[str, torch.Tensor]) -> None:
    """adapter_config.json and adapter_model.safetensors in peft's layout."""
    from safetensors.torch import save_file

    adapter_config.save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / ADAPTER_WEIGHTS_FILE),
              metadata={"format": "pt"})


def load_adapter_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {ADAPTER_WEIGHTS_FILE} (not a LoRA checkpoint)")
    return load_file(str(path))


def _save_atomically(directory: str | Path, write_weights, *, optimizer_state: dict, state: TrainerState,
                     tokenizer_dir: str | Path | None) -> Path:
    target = Path(directory).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        check_replaceable(target, state.run_id)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))  # new, empty, ours alone
    try:
        write_weights(tmp)
        if tokenizer_dir is not None:
            copy_tokenizer_files(Path(tokenizer_dir), tmp)
        with open(tmp / OPTIMIZER_FILE, "wb") as f:  # a Python file: a full disk surfaces as OSError ENOSPC
            torch.save(optimizer_state, f)
        (tmp / STATE_FILE).write_text(state.to_json())
        if target.exists():
            check_replaceable(target, state.run_id)  # again: it may have changed while the weights were written
            # rename() replaces an empty directory only, so the old checkpoint moves aside onto a fresh empty
            # name first; at every instant one complete checkpoint is on disk.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def write_model_dir(directory: Path, lm: torch.nn.Module, weights: dict[str, torch.Tensor],
                    compute_dtype: torch.dtype) -> None:
    """config.json, generation_config.json and model.safetensors of `weights` (whole tensors, no aliases).

    config.json names the run's compute dtype, so a loader that follows it ("auto") serves the
    same cast the rollout was sent; the stored tensors are the float32 masters."""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(lm.config)
    config.dtype = compute_dtype
    config.save_pretrained(str(directory))
    generation = getattr(lm, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})


def read_optimizer_state(directory: str | Path) -> dict:
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {OPTIMIZER_FILE}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a refused pickle or a broken zip: the file's fault, named
        raise load_failure(path, exc) from exc


def read_state(directory: str | Path) -> TrainerState:
    d = Path(directory)
    path = d / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{d}: not a Lockstep trainer checkpoint (no {STATE_FILE})")
    return TrainerState.from_json(path.read_text(), where=str(path))


def load_safetensors_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    d = Path(directory)
    single = d / "model.safetensors"
    if single.is_file():
        return load_file(str(single))
    if not (d / SAFETENSORS_INDEX).is_file():
        raise FileNotFoundError(f"{d}: no model.safetensors or {SAFETENSORS_INDEX}")
    out: dict[str, torch.Tensor] = {}
    for shard in weight_files(d):  # the index's shards, each a file of the directory itself
        out.update(load_file(str(shard)))
    return out


def check_weights_match(model: torch.nn.Module, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Refuse checkpoint weights that do not cover every model tensor exactly (names, shapes, dtypes).

    Tied tensors (one storage under several names) count once, under any of
    their names, because checkpoints drop tied aliases. Shapes of sharded
    parameters are their whole shapes.
    """
    targets = model.state_dict(keep_vars=True)
    problems = [f"{n}: not a tensor of the model" for n in weights if n not in targets]
    problems += [
        f"{n}: shape {tuple(t.shape)} != model's {tuple(targets[n].shape)}"
        for n, t in weights.items()
        if n in targets and t.shape != targets[n].shape
    ]
    problems += [
        f"{n}: dtype {t.dtype} != model's {targets[n].dtype}"
        for n, t in weights.items()
        if n in targets and t.dtype != targets[n].dtype
    ]
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    problems += [f"{names[0]}: missing" for names in groups.values() if not any(n in weights for n in names)]
    if problems:
        raise ValueError(f"{where}: weights do not match the model: " + "; ".join(problems[:8]))


def check_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Refuse, before anything is modified, a state that load_state_dict would reject half-way."""
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{OPTIMIZER_FILE}: parameter groups do not match the optimizer")
    for i, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        if len(mine["params"]) != len(theirs.get("params", ())):
            raise ValueError(f"{OPTIMIZER_FILE}: group {i} holds {len(theirs.get('params', ()))} params, "
                             f"the optimizer {len(mine['params'])}")


# ------------------------------------------------------------ a configured run --


def save_run(run: RunState, directory: str, *, write: bool) -> Path:
    """The run's checkpoint in `directory`: masters (float32 safetensors, HF-loadable; a LoRA run's adapters)
    and the whole optimizer state. Collective in a group: every rank gathers, the one with `write` writes
    (the others return the path it is written at)."""
    sharding.reshard(run.policy)
    if run.config.lora is not None:
        weights = {key: t.cpu() for key, t in lora.named_adapter_tensors(run.policy.lm)}
    else:
        weights = {name: t.cpu() for name, t in sharding.named_master_tensors(run.policy.lm)}
    optim_state = sharding.optimizer_state(run.policy.lm, run.optimizer)
    if not write:
        return Path(directory).resolve()
    if run.config.lora is not None:
        return save_adapter_checkpoint(
            directory,
            adapter_config=lora.saved_adapter_config(run.policy.lm, run.config.lora, base_model_path=run.model_path),
            weights=weights, optimizer_state=optim_state, state=TrainerState.of_run(run), tokenizer_dir=run.model_path,
        )
    return save_checkpoint(
        directory, lm=run.policy.lm, weights=weights, compute_dtype=run.compute_dtype, optimizer_state=optim_state,
        state=TrainerState.of_run(run), tokenizer_dir=run.model_path,
    )


@dataclass(frozen=True)
class RunCheckpoint:
    """A checkpoint of a run, read and checked against it: nothing of the run is changed yet."""

    state: TrainerState
    weights: dict[str, torch.Tensor]  # the masters (a LoRA run's adapters) by saved name
    optimizer_state: dict


def read_run(run: RunState, directory: str) -> RunCheckpoint:
    """`directory`'s checkpoint of `run`, every name, shape and dtype checked against the run's model and
    optimizer; FileNotFoundError or ValueError otherwise."""
    state = read_state(directory)
    if state.run_id != run.run_id:
        raise ValueError(f"checkpoint belongs to run {state.run_id!r}, not {run.run_id!r}")
    adapters = run.config.lora is not None
    weights = load_adapter_weights(directory) if adapters else load_safetensors_weights(directory)
    optim_state = read_optimizer_state(directory)
    check_optimizer_state(run.optimizer, optim_state)
    if adapters:
        lora.check_adapter_weights(run.policy.lm, weights, where="directory")
    else:
        check_weights_match(run.policy.lm, weights, where="directory")
    return RunCheckpoint(state, weights, optim_state)


def restore_run(run: RunState, saved: RunCheckpoint) -> None:
    """Load `saved` (read_run's) into `run`: weights, optimizer state, policy version, step metrics and
    digests. Collective in a group."""
    run.weights_epoch += 1
    sharding.reshard(run.policy)
    if run.config.lora is not None:
        lora.load_adapter_tensors(run.policy.lm, saved.weights)
    else:
        sharding.load_master_tensors(run.policy.lm, saved.weights)
    sharding.load_optimizer_state(run.policy.lm, run.optimizer, saved.optimizer_state)
    run.policy_version = saved.state.policy_version
    run.step_metrics = dict(saved.state.step_metrics)
    run.step_digests = dict(saved.state.step_digests)
