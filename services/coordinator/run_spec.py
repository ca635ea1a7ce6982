"""The run spec users submit (POST /v1/runs, `lockstep submit recipe.yaml`).

Everything a run needs is validated here, at submit time: a spec that names a
missing model directory or an unknown task is refused with 422 before anything
is stored, not discovered at step 40. `parse_run_spec` is the REST edge: the
body is parsed with bounded size and nesting, then validated in pydantic's
strict mode (no `true` for a number, no `5.5` for an integer, no "3" for
either), and engine options are checked against the engine's own schema.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from contract.command_line import check_arg_value
from contract.engine_options import (
    SERVICE_OWNED_OPTIONS,
    EngineConfigError,
    check_engine_options,
    service_owned_reason,
)
from contract.trainer_run import TrainerRunConfig
from contract.trainer_settings import Numerics, TeacherSettings
from services.common.bounded_json import MAX_JSON_DEPTH, check_depth, loads_bounded
from services.common.float32_fields import Float32
from services.common.models.directory import check_model_dir
from services.common.path_roots import OutsideRoots, resolve_inside
from services.coordinator.rewards.spec import RewardSpec, confine_reward, reward_refusal
from services.coordinator.sft.dataset import SftSpec, read_sft_dataset
from services.coordinator.spec_sections import (
    MAX_EVAL_PROBLEMS,
    MAX_EVAL_SAMPLES,
    MAX_EVAL_SETS,
    MAX_PATH_LENGTH,
    AsyncSpec,
    CheckpointSpec,
    DebugSpec,
    EvalSetSpec,
    EvalSpec,
    StartFromSpec,
    StrictModel,
    field_error,
    fields_error,
    kind_refusal,
    teacher_refusal,
)
from services.coordinator.tasks import (
    build_task,
    chat_prompt_problem,
    known_tasks,
    read_eval_set,
    task_path_options,
)
from services.coordinator.tasks.episodic import EpisodicTask
from services.coordinator.tracking.spec import SamplesSpec, TrackingSpec

MAX_SPEC_BYTES = 1024 * 1024
"""Largest run spec body accepted (the shipped recipes are under 4 KiB)."""
MAX_FREE_FORM_DEPTH = 8
"""Deepest nesting inside engine_options and task.options (the engines' schemas need 2)."""


class SamplingSpec(StrictModel):
    temperature: Float32 = Field(1.0, ge=0.01, le=10, description="Sampling temperature; log-probs are scored at "
                                 "it. Sent as float32, so it must be one that float32 carries.")
    top_p: Float32 = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (float32 on the wire).")
    top_k: int = Field(0, ge=0, le=1_000_000, description="Top-k sampling; 0 disables it.")
    max_new_tokens: int = Field(16, ge=1, le=32768, description="Response length cap in tokens.")


class DynamicSamplingSpec(StrictModel):
    enabled: bool = Field(
        False, description="Train only on groups whose rewards differ (DAPO): zero-variance groups are dropped and "
        "further prompts sampled until the step holds prompts_per_step informative groups.")
    max_rounds: int = Field(4, ge=1, le=64, description="Extra sampling rounds (prompts_per_step prompts each) at most.")


class RolloutSpec(StrictModel):
    engine: Literal["torch", "sglang"] = Field("torch", description="Rollout engine every replica loads.")
    engine_options: dict = Field(
        default_factory=dict,
        description="Engine-specific options, validated at submit time against the engine's own options model "
        "(the one LoadModel applies); an unknown key is refused. What runs on the rollout host, where it "
        "writes and where it listens (the SGLang interpreter, weight and log directories, server URL, host and "
        "port, extra flags) is the rollout service's configuration and cannot be set here. Options that become "
        "SGLang server flags take enumerations and numbers only, so no value reads as a flag.")
    prompts_per_step: int = Field(16, ge=1, le=65536, description="Prompts (GRPO groups) sampled per step.")
    samples_per_prompt: int = Field(8, ge=2, le=1024, description="Group size; GRPO needs at least 2.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling parameters.")
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec, description="Drop zero-variance groups and sample more (DAPO).")
    weight_sync: Literal["grpc", "shared_path", "broadcast", "ipc", "auto"] = Field(
        "grpc", description="How replicas get each new policy version: 'grpc' streams it from the trainer "
        "(SyncWeights; any host); 'shared_path' has the trainer write it once as safetensors under the run's "
        "directory and every replica read that directory (the run directory must lie inside the trainer's "
        "checkpoint_roots and the rollout services' model_roots); 'broadcast' has the trainer broadcast it in "
        "buckets over a torch.distributed group of itself and the replicas being synced (NCCL/RCCL on GPUs, "
        "gloo on CPU; the trainer's weight_broadcast_address, listed in every replica's broadcast_sources). "
        "Each verifies the trainer's digest. 'ipc' hands the trainer's buffers over in place (CUDA/HIP IPC, or shared "
        "memory for a trainer on CPU) to torch-engine replicas on the trainer's node that see its GPU; the run fails "
        "naming any replica it cannot reach. 'auto' uses 'ipc' when every replica can be reached so, else "
        "weight_sync_fallback; the choice and its reason are the event weight_source_chosen.")
    weight_sync_fallback: Literal["grpc", "shared_path", "broadcast"] = Field(
        "grpc", description="The source weight_sync 'auto' uses when 'ipc' cannot reach every replica.")

    @property
    def non_ipc_source(self) -> str:
        """The source a run uses when not IPC: weight_sync itself, or the fallback of 'ipc' and 'auto'."""
        return self.weight_sync_fallback if self.weight_sync in ("ipc", "auto") else self.weight_sync

    @field_validator("engine_options")
    @classmethod
    def _engine_accepts_options(cls, v: dict, info: ValidationInfo) -> dict:
        _bounded_free_form(v)
        engine = info.data.get("engine")
        where = "rollout.engine_options"
        if engine == "sglang":
            for key in sorted(set(v) & set(SERVICE_OWNED_OPTIONS)):
                raise field_error(f"{where}.{key}", service_owned_reason(key))
        if engine is not None:  # a bad engine name is reported on its own field
            try:
                check_engine_options(engine, json.dumps(v))
            except EngineConfigError as exc:  # each bad option under its own name
                raise fields_error([(f"{where}.{option}" if option else where, reason)
                                    for option, reason in exc.fields]) from None
        return v


def _bounded_free_form(value: dict) -> dict:
    check_depth(value, MAX_FREE_FORM_DEPTH)  # JsonTooDeep is a ValueError: "nested deeper than 8 levels"
    return value


class TaskSpec(StrictModel):
    name: str = Field(..., max_length=64, description="Registered task name (e.g. 'arithmetic').",
                      json_schema_extra={"enum": list(known_tasks())})
    options: dict = Field(default_factory=dict, description="Options of the task (its own strict model: "
                          "services/coordinator/tasks/).")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in known_tasks():
            raise ValueError(f"unknown task {v!r}; known: {sorted(known_tasks())}")
        return v

    @field_validator("options")
    @classmethod
    def _task_builds(cls, v: dict, info: ValidationInfo) -> dict:
        _bounded_free_form(v)
        name = info.data.get("name")
        if name is not None:  # a bad name is reported on its own field
            build_task(name, v).close()  # raises ValueError naming the bad option
        return v


class RunSpec(StrictModel):
    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)  # `async` is a keyword: stored by its alias

    name: str = Field(..., min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Human-readable run name.")
    model_path: str = Field(..., min_length=1, max_length=MAX_PATH_LENGTH,
                            description="Hugging Face causal-LM directory visible to the coordinator, rollout and trainer.")
    seed: int = Field(0, ge=0, le=2**62, description="Seeds prompt sampling, rollout sampling and training.")
    steps: int = Field(..., ge=1, le=1_000_000, description="Optimizer steps (one rollout batch each).")
    task: TaskSpec = Field(..., description="Verifiable task supplying prompts and rewards.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engine and sampling.")
    trainer: TrainerRunConfig = Field(default_factory=TrainerRunConfig, description="Trainer hyperparameters.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Periodic evaluation (avg@k, pass@k) on the "
                           "task's held-out split and extra held-out sets.")
    kind: Literal["rl", "sft"] = Field("rl", description="'rl': sampled prompts trained on their rewards (or a "
                                       "teacher's). 'sft': the `sft` dataset's completions; the task only evaluates.")
    sft: SftSpec | None = Field(None, description="The dataset of a kind 'sft' run: prompt/completion pairs or chat "
                                "messages, JSON Lines or Parquet, read and tokenized at submit.")
    start_from: StartFromSpec | None = Field(
        None, description="Start from another run's checkpoint (its last, or `step`'s): resolved at submit into "
        "model_path, which the spec must then leave out (services/coordinator/start_from.py).")
    teacher: TeacherSettings | None = Field(
        None, description="On-policy distillation (docs/distillation.md): a teacher model that scores every token "
        "the student samples; each token's advantage is teacher.kl_weight times the (discounted) teacher - student "
        "log-prob plus teacher.reward_weight times the task's advantage. Its tokenizer must be the student's. "
        "null = plain RL on the task's reward.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Where training rewards come from: the "
                               "task's rule, a reward model, a judge, or a weighted combination (docs/rewards.md); "
                               "held-out evaluation always uses the task's rule.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoint cadence.")
    debug: DebugSpec = Field(default_factory=DebugSpec, description="Debugging aids.")
    # Samples kept per step and experiment trackers (services/coordinator/tracking/, docs/tracking.md).
    samples: SamplesSpec = Field(default_factory=SamplesSpec, description="Each step's samples, kept for the "
                                 "samples API and `lockstep samples`.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="Experiment trackers (W&B, "
                                   "TensorBoard, MLflow) the run is logged to.")
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async",
                              description="Asynchronous RL: how far rollouts may run ahead of training (docs/async.md).")
    numerics: Numerics = Field(
        "fast", description="'fast': rollout and trainer each run their fastest kernels; their log-probs agree up "
        "to rounding, which the step-1 parity gate bounds (trainer.parity_gate). 'true_on_policy': the torch engine "
        "and the trainer run every op from token ids to a log-prob on batch-invariant kernels, so at every step the "
        "trainer's recompute of each response token's log-prob has the rollout's bits (importance weights exactly "
        "1) and the gate demands that equality. Needs rollout.engine 'torch'; it sets trainer.numerics and "
        "rollout.engine_options.numerics, which may only repeat it.")

    @field_validator("model_path")
    @classmethod
    def _model_exists(cls, v: str) -> str:
        try:
            return str(check_model_dir(v).resolve())
        except FileNotFoundError as exc:
            raise ValueError(str(exc).removeprefix("model_path: ")) from None
        except OSError as exc:  # ENAMETOOLONG, EACCES, ELOOP: the path cannot be a model directory
            raise ValueError(f"cannot read {v!r}: {exc.strerror}") from None

    @field_validator("teacher")
    @classmethod
    def _teacher_shares_the_vocabulary(cls, v: TeacherSettings | None, info: ValidationInfo) -> TeacherSettings | None:
        if v is not None and (refusal := teacher_refusal(v.model_path, info.data.get("model_path"))):
            raise field_error("teacher.model_path", refusal)
        return v

    @field_validator("sft")
    @classmethod
    def _sft_dataset_reads(cls, v: SftSpec | None, info: ValidationInfo) -> SftSpec | None:
        model_path = info.data.get("model_path")
        if v is None or model_path is None:  # a bad model_path is reported on its own field
            return v
        try:
            read_sft_dataset(v, model_path)
        except (ValueError, OSError) as exc:
            raise field_error("sft.path", str(exc)) from None
        return v

    @field_validator("eval")
    @classmethod
    def _eval_sets_readable(cls, v: EvalSpec, info: ValidationInfo) -> EvalSpec:
        task = info.data.get("task")
        if task is None:  # a bad task is reported on its own field
            return v
        total = v.heldout_size  # an upper bound: the held-out split may hold fewer
        for i, eval_set in enumerate(v.sets):
            field = f"eval.sets.{i}.path"
            try:
                total += len(read_eval_set(task.name, task.options, eval_set.path, field))
            except ValueError as exc:
                raise field_error(field, str(exc).removeprefix(f"{field}: ")) from None
            if total > MAX_EVAL_PROBLEMS:
                raise field_error(field, f"brings the problems of one evaluation past {MAX_EVAL_PROBLEMS}")
        if total * v.k > MAX_EVAL_SAMPLES:
            raise field_error("eval.k", f"{v.k} samples of each of up to {total} problems exceed "
                              f"{MAX_EVAL_SAMPLES} samples per evaluation")
        return v

    @model_validator(mode="after")
    def _episodes_fit_the_model(self) -> "RunSpec":
        # An episode longer than the model's longest sequence would fail a later turn's Generate, and the
        # run with it: refuse it here, where the field can be named. (The rollout checks its own engine's
        # bound again, max_context_tokens included.)
        task = build_task(self.task.name, self.task.options)
        try:
            if not isinstance(task, EpisodicTask):
                return self
            budget = task.episode.max_episode_tokens
        finally:
            task.close()
        try:
            longest = json.loads((Path(self.model_path) / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            return self  # the rollout refuses it at load, naming what is wrong
        if isinstance(longest, int) and budget > longest:
            raise field_error("task.options.episode.max_episode_tokens", f"{budget} exceeds the model's "
                              f"max_position_embeddings {longest}")
        return self

    @model_validator(mode="after")
    def _architecture_is_covered(self) -> "RunSpec":
        # MoE families outside kernels/moe, and true_on_policy on a family without batch-invariant kernels,
        # would fail at the trainer's or rollout's load: refuse them here, naming the model (docs/moe.md).
        from contract.models.model_families import unsupported_reason

        try:
            config = json.loads((Path(self.model_path) / "config.json").read_text())
        except (OSError, ValueError):
            return self  # the rollout refuses it at load, naming what is wrong
        reason = unsupported_reason(config, self.numerics) if isinstance(config, dict) else None
        if reason is not None:
            raise field_error("model_path", reason)
        return self

    @model_validator(mode="after")
    def _replay_has_recorded_experts(self) -> "RunSpec":
        if not self.trainer.moe.routing_replay or self.rollout.engine == "torch":
            return self
        if self.rollout.engine == "sglang" and (self.rollout.engine_options or {}).get("return_routed_experts"):
            return self
        raise field_error("trainer.moe.routing_replay", f"needs the experts of every token from the rollout; "
                          f"engine {self.rollout.engine!r} does not return them as configured (the torch engine "
                          "does; sglang does with rollout.engine_options.return_routed_experts: true)")

    @model_validator(mode="after")
    def _samples_tables_have_samples(self) -> "RunSpec":
        # The trackers' samples tables are read from the kept samples: without them there would be none.
        if self.tracking.backends and self.tracking.samples_every and not self.samples.keep_steps:
            raise field_error("tracking.samples_every", f"{self.tracking.samples_every} needs samples.keep_steps > 0 "
                              "(the tables are read from the kept samples); set it to 0 for no tables")
        return self

    @model_validator(mode="after")
    def _chat_prompts_render(self) -> "RunSpec":
        # Chat prompts are rendered by the model's chat template during the run: refused now if they cannot be.
        problem = chat_prompt_problem(self.task.name, self.task.options, [s.path for s in self.eval.sets],
                                      self.model_path)
        if problem is not None:
            raise field_error(*problem)
        return self

    @model_validator(mode="after")
    def _sglang_model_path_fits_a_command_line(self) -> "RunSpec":
        # The SGLang server is launched with --model-path=<this directory>: the path keeps the grammar of
        # every run-chosen command-line value (contract/command_line.py), as the rollout checks again at launch.
        if self.rollout.engine == "sglang":
            try:
                check_arg_value(self.model_path, "model_path")
            except ValueError as exc:
                raise field_error("model_path", str(exc).removeprefix("model_path: ")) from None
        return self

    @model_validator(mode="after")
    def _sglang_serves_the_adapters(self) -> "RunSpec":
        # A LoRA policy reaches SGLang as adapters: its server must be launched to serve them at this
        # rank, or the run would only fail at its first weight sync.
        lora = self.trainer.lora
        if lora is None or self.rollout.engine != "sglang":
            return self
        server = self.rollout.engine_options.get("server") or {}
        max_rank = server.get("max_lora_rank") if isinstance(server, dict) else None
        if not isinstance(max_rank, int) or max_rank < lora.rank:
            raise ValueError(f"rollout.engine_options.server.max_lora_rank ({max_rank}) must be set to at least "
                             f"trainer.lora.rank ({lora.rank}): the SGLang server serves the run's adapters")
        return self

    @model_validator(mode="after")
    def _one_numerics_mode(self) -> "RunSpec":
        # Bitwise agreement needs both sides in the mode: one field decides, the others may only repeat it.
        mode = self.numerics
        options = self.rollout.engine_options
        for field, value in (("trainer.numerics", self.trainer.numerics if "numerics" in self.trainer.model_fields_set
                              else None), ("rollout.engine_options.numerics", options.get("numerics"))):
            if value is not None and value != mode:
                raise ValueError(f"{field}: {value!r} differs from the run's numerics {mode!r}; set `numerics` "
                                 "once for the run (it configures both the rollout engine and the trainer)")
        if mode == "fast":
            return self
        if self.rollout.engine != "torch":
            raise ValueError(f"rollout.engine: {self.rollout.engine!r} cannot run numerics 'true_on_policy', which "
                             "needs the torch engine's batch-invariant decoder (SGLang's deterministic inference "
                             "is reproducible but not bitwise the trainer's)")
        backend = options.get("logprob_backend", "auto")
        if backend != "auto":
            raise ValueError(f"rollout.engine_options.logprob_backend: {backend!r} is refused with numerics "
                             "'true_on_policy': the trainer scores with the 'auto' log-prob backend, and another "
                             "kernel would give the rollout's log-probs other bits")
        try:
            self.trainer = TrainerRunConfig.model_validate({**self.trainer.model_dump(), "numerics": mode})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"trainer{'.' + where if where else ''}: {err['msg'].removeprefix('Value error, ')}") \
                from None
        self.rollout.engine_options = {**options, "numerics": mode}
        return self

    @model_validator(mode="after")
    def _kind_is_consistent(self) -> "RunSpec":
        # kind decides the trainer's objective; trainer.objective may only repeat it (as a stored spec does).
        if refusal := kind_refusal(self):
            raise field_error(*refusal)
        if self.kind == "sft":
            self.trainer = TrainerRunConfig.model_validate({**self.trainer.model_dump(), "objective": "sft"})
        return self

    @model_validator(mode="after")
    def _reward_can_score(self) -> "RunSpec":
        if refusal := reward_refusal(self):
            raise field_error(*refusal)
        return self

    @model_validator(mode="after")
    def _teacher_reaches_the_trainer(self) -> "RunSpec":
        # The trainer scores with it: the top-level `teacher` decides, trainer.teacher may only repeat it.
        own = self.trainer.teacher
        if self.teacher is None:
            if own is not None:
                raise field_error("trainer.teacher", "set the run's top-level `teacher` instead")
            return self
        if own is not None and own != self.teacher:
            raise field_error("trainer.teacher", "differs from the run's `teacher`; set `teacher` once")
        teacher = self.teacher.model_dump()
        self.trainer = TrainerRunConfig.model_validate({**self.trainer.model_dump(), "teacher": teacher})
        return self

    @model_validator(mode="after")
    def _temperatures_agree(self) -> "RunSpec":
        # The trainer must score tokens at the temperature they were sampled at,
        # or step-1 importance weights are off by construction.
        if self.trainer.temperature != self.rollout.sampling.temperature:
            raise ValueError(
                f"trainer.temperature ({self.trainer.temperature}) must equal "
                f"rollout.sampling.temperature ({self.rollout.sampling.temperature})"
            )
        return self

    @model_validator(mode="after")
    def _async_is_corrected(self) -> "RunSpec":
        # A stale rollout is another policy's sample: without a correction the PPO ratio is taken against the
        # behaviour policy as if it were the proximal one, and nothing bounds the update.
        if self.trainer.lr_schedule.staleness_scaling != "none" and self.async_.max_staleness < 2:
            # A mean staleness of at most 1 leaves lr / max(1, tau) at lr: the setting would do nothing.
            raise field_error("trainer.lr_schedule.staleness_scaling",
                              f"{self.trainer.lr_schedule.staleness_scaling!r} needs async.max_staleness >= 2 "
                              f"(it is {self.async_.max_staleness}, where every step keeps its rate); set 'none'")
        if self.async_.max_staleness == 0:
            return self
        if self.trainer.mismatch_correction.mode == "none" and self.trainer.policy_loss.kind != "m2po":
            raise field_error("trainer.mismatch_correction.mode", f"'none' cannot train async.max_staleness "
                              f"{self.async_.max_staleness} (off-policy rollouts): set it to 'truncate' or 'mask' "
                              "(decoupled PPO with TIS/MIS weights) or use trainer.policy_loss.kind 'm2po'")
        if self.async_.mode == "streaming":
            if self.rollout.dynamic_sampling.enabled:
                raise field_error("async.mode", "'streaming' makes one rollout round per step; it cannot be "
                                  "combined with rollout.dynamic_sampling.enabled (use 'fixed_lag')")
            task = build_task(self.task.name, self.task.options)
            try:
                episodic = isinstance(task, EpisodicTask)
            finally:
                task.close()
            if episodic:
                raise field_error("async.mode", f"'streaming' pauses single-turn samples mid-sequence; task "
                                  f"{self.task.name!r} runs multi-turn episodes, which it cannot pause: use "
                                  "'fixed_lag'")
        if self.eval.every > 0:
            raise field_error("eval.every", f"{self.eval.every}: mid-run evaluations need the replicas at the "
                              f"trainer's version, which async.max_staleness {self.async_.max_staleness} keeps "
                              "behind it; set 0 (evaluations before step 1 and after the last step)")
        return self

    @model_validator(mode="after")
    def _weight_sync_carries_the_policy(self) -> "RunSpec":
        # The checks of the source in use when not IPC apply to weight_sync_fallback under 'auto'.
        where = "rollout.weight_sync_fallback" if self.rollout.weight_sync == "auto" else "rollout.weight_sync"
        if self.rollout.weight_sync == "ipc" and self.rollout.engine != "torch":
            raise field_error("rollout.weight_sync", f"'ipc' maps the trainer's buffers into the replica's own "
                              f"process; engine {self.rollout.engine!r} holds its model in another (use 'auto' or "
                              "another source)")
        source = self.rollout.non_ipc_source if self.rollout.weight_sync != "ipc" else "ipc"
        # WriteWeights writes whole models; a LoRA run's adapters carry their rank and alpha on the stream.
        if source == "shared_path" and self.trainer.lora is not None:
            raise field_error(where, "'shared_path' writes whole models; a run with trainer.lora "
                              "syncs its adapters with 'grpc'")
        if source == "broadcast" and self.rollout.engine == "sglang" and self.trainer.lora is not None:
            # SGLang's /update_weights_from_distributed loads model weights; its adapters load from files or
            # serialized tensors (/load_lora_adapter, /load_lora_adapter_from_tensors), never from a group.
            raise field_error(where, "'broadcast' to engine sglang carries whole models (SGLang "
                              "loads LoRA adapters from files or tensors, not from a process group); a run with "
                              "trainer.lora and engine sglang syncs its adapters with 'grpc'")
        return self


def _inside(value: object, roots: Sequence[str], field: str) -> object:
    if not isinstance(value, str):
        return value  # the field's own type check reports it
    try:
        return str(resolve_inside(value, roots, field))
    except OutsideRoots as exc:
        raise ValueError(str(exc).removeprefix(f"{field}: ")) from None


def confined_run_spec(model_roots: Sequence[str], data_roots: Sequence[str],
                      scorer_addresses: Sequence[str] = ()) -> type[RunSpec]:
    """RunSpec as the REST API accepts it: every path resolved inside the coordinator's roots.

    The roots are checked before anything opens or even tests the path (the base class's checks run
    after these), so a path outside them answers the same whether or not it exists. Same schema and
    name as RunSpec: only the checks differ."""
    model_roots, data_roots, scorers = tuple(model_roots), tuple(data_roots), tuple(scorer_addresses)

    class ConfinedTaskSpec(TaskSpec):
        @model_validator(mode="before")
        @classmethod
        def _data_inside_roots(cls, data: object) -> object:
            if isinstance(data, dict) and isinstance(data.get("options"), dict) and isinstance(data.get("name"), str):
                options = dict(data["options"])
                for key in task_path_options(data["name"]):
                    if options.get(key):
                        try:
                            options[key] = str(resolve_inside(options[key], data_roots, f"options.{key}"))
                        except OutsideRoots as exc:
                            raise ValueError(str(exc)) from None
                data = {**data, "options": options}
            return data

    class ConfinedEvalSetSpec(EvalSetSpec):
        @field_validator("path", mode="before")
        @classmethod
        def _set_inside_roots(cls, v: object) -> object:
            return _inside(v, data_roots, "path")

    class ConfinedEvalSpec(EvalSpec):
        sets: list[ConfinedEvalSetSpec] = Field(default_factory=list, max_length=MAX_EVAL_SETS,
                                                description=EvalSpec.model_fields["sets"].description)

    class ConfinedSftSpec(SftSpec):
        @field_validator("path", mode="before")
        @classmethod
        def _dataset_inside_roots(cls, v: object) -> object:
            return _inside(v, data_roots, "path")

    class ConfinedRunSpec(RunSpec):
        task: ConfinedTaskSpec = Field(..., description=RunSpec.model_fields["task"].description)
        sft: ConfinedSftSpec | None = Field(None, description=RunSpec.model_fields["sft"].description)
        eval: ConfinedEvalSpec = Field(default_factory=ConfinedEvalSpec,
                                       description=RunSpec.model_fields["eval"].description)

        @field_validator("model_path", mode="before")
        @classmethod
        def _model_inside_roots(cls, v: object) -> object:
            return _inside(v, model_roots, "model_path")

        @field_validator("reward", mode="before")
        @classmethod
        def _scorers_inside_the_fleet(cls, v: object) -> object:
            return confine_reward(v, model_roots, scorers)

        @field_validator("teacher", mode="before")
        @classmethod
        def _teacher_inside_roots(cls, v: object) -> object:
            if not isinstance(v, dict) or not isinstance(v.get("model_path"), str):
                return v  # the teacher's own checks report it
            try:
                return {**v, "model_path": str(resolve_inside(v["model_path"], model_roots, "model_path"))}
            except OutsideRoots as exc:
                raise field_error("teacher.model_path", str(exc).removeprefix("model_path: ")) from None

    for confined, name in ((ConfinedTaskSpec, "TaskSpec"), (ConfinedEvalSetSpec, "EvalSetSpec"),
                           (ConfinedSftSpec, "SftSpec"),
                           (ConfinedEvalSpec, "EvalSpec"), (ConfinedRunSpec, "RunSpec")):
        confined.__name__ = confined.__qualname__ = name
        confined.model_rebuild(force=True)
    return ConfinedRunSpec


class RunSpecError(ValueError):
    """A refused run spec: `fields` is [{"field": "rollout.engine_options", "reason": "..."}]."""

    def __init__(self, fields: list[dict[str, str]]) -> None:
        self.fields = fields
        super().__init__("; ".join(f"{f['field']}: {f['reason']}" for f in fields))


def validation_fields(errors: list[dict]) -> list[dict[str, str]]:
    """pydantic's errors as [{"field": "trainer.lr", "reason": "..."}] ("(body)" for the spec as a whole)."""
    out = []
    for err in errors:
        if err.get("type") == "refused_field":  # raised above the field it concerns (field_error)
            out.append({"field": err["ctx"]["field"], "reason": err["ctx"]["reason"]})
            continue
        if err.get("type") == "refused_fields":  # fields_error
            out += [{"field": field, "reason": reason} for field, reason in err["ctx"]["fields"]]
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        out.append({"field": ".".join(loc) or "(body)", "reason": err.get("msg", "invalid").removeprefix("Value error, ")})
    return out


def parse_run_spec(body: bytes, spec: type[RunSpec] = RunSpec) -> RunSpec:
    """The REST edge: a submitted body -> a validated `spec` (RunSpec, or the coordinator's
    confined_run_spec), or RunSpecError naming every bad field.

    Blocking (it reads datasets and builds the task's splits): call it off the event loop.
    """
    try:
        raw = loads_bounded(body, field="(body)", max_bytes=MAX_SPEC_BYTES, max_depth=MAX_JSON_DEPTH)
    except ValueError as exc:
        field, _, reason = str(exc).partition(": ")
        raise RunSpecError([{"field": field.removeprefix("(body)."), "reason": reason}]) from None
    if not isinstance(raw, dict):
        raise RunSpecError([{"field": "(body)", "reason": f"expected a JSON object, got {type(raw).__name__}"}])
    try:
        return spec.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise RunSpecError(validation_fields(exc.errors())) from None
