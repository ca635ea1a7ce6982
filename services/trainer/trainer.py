"""The trainer core: one run's model, optimizer and policy version; no gRPC here.

Step semantics (what the coordinator relies on for exactly-once training):
- The trainer holds `policy_version` v. TrainStep(step s) applies one update
  iff v == s - 1, after which v = s and the step's metrics are recorded.
- TrainStep(s) with v == s is a replay (the coordinator died after the update
  but before recording it): the recorded metrics come back, nothing trains.
  A replay that carries trajectories must carry the ones step s was trained on
  (step_digest.py), in any order.
- Anything else is refused (FailedPrecondition) and changes nothing.

Calls are not thread-safe; the server serializes them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from contract.trainer_run import TrainerRunConfig
from services.common.determinism import configure_determinism
from services.common.records.fingerprint import probe_platform_details
from services.trainer import checkpoint as ckpt
from services.trainer import run_setup
from services.trainer.data.batching import Microbatch, TrainSample, canonical_order
from services.trainer.data.step_digest import check_replay, trajectories_digest
from services.trainer.data.wire import FailedPrecondition, InvalidRequest, StepRequest
from services.trainer.distributed import sharding
from services.trainer.distributed.data_parallel import DataParallel
from services.trainer.loss.lr_schedule import lr_at, mean_token_staleness, staleness_factor
from services.trainer.loss.microbatch_result import (
    MicrobatchResult,
    TokenDeltas,
    results_sample_weights,
    results_step_metrics,
    step_loss,
)
from services.trainer.loss.passes import forward_backward
from services.trainer.loss.policy_loss import StepShape, m2po_keep_mask, step_shape
from services.trainer.loss.update_guard import nonfinite_update
from services.trainer.model import lora
from services.trainer.model.moe import check_routing, microbatch_routing
from services.trainer.parity_gate import ParityVerdict, check_parity
from services.trainer.run_setup import build_microbatches, parse_run_config
from services.trainer.run_state import RunState, WeightSnapshot
from services.trainer.teacher import distillation_metrics, load_teacher, teacher_pass

log = logging.getLogger("lockstep.trainer")
# What crosses ranks in microbatch order (Trainer._in_order).
R = TypeVar("R", MicrobatchResult, TokenDeltas)


@dataclass(frozen=True)
class ScoredTokens:
    """Every response token of a step as the trainer scores it, aligned with the rollout's log-probs."""

    logp: torch.Tensor
    rollout_logp: torch.Tensor
    sample_index: torch.Tensor
    positions: torch.Tensor
    sample_ids: tuple[str, ...]
    attention_backend: str
    logprob_backend: str
    numerics: str


class StepFailed(RuntimeError):
    """The update could not be applied (e.g. non-finite gradients); nothing changed."""


class ParityGateFailed(FailedPrecondition):
    """Step-1 parity gate: trainer and rollout disagree before any update; nothing changed.

    str() is the full diagnostic (IW statistics, worst tokens, backends in use)."""

    def __init__(self, verdict: ParityVerdict) -> None:
        super().__init__(verdict.message())
        self.verdict = verdict


@dataclass(frozen=True)
class StepOutcome:
    step: int
    policy_version: int
    metrics: dict[str, float]
    replayed: bool
    sample_weights: tuple[tuple[str, float, float], ...] = ()
    """(sample id, smallest IW, largest IW) of each sample of a trained step; empty for a replay."""


class Trainer:
    """One run's model and optimizer. With `dp` this is one rank of a data-parallel group
    (services/trainer/distributed/data_parallel.py): it trains its share of each step's microbatches."""

    def __init__(self, *, device: str = "cpu", num_threads: int = 0, dp: DataParallel | None = None) -> None:
        self.device = device
        self.num_threads = num_threads
        self.dp = dp
        self.run: RunState | None = None
        if dp is None:
            sharding.ensure_single_process_group(torch.device(device))

    @property
    def is_rank0(self) -> bool:
        return self.dp is None or self.dp.rank == 0

    # ------------------------------------------------------------ configure --

    def configure(
        self, *, run_id: str, model_path: str, seed: int, config_json: str, resume_checkpoint: str = ""
    ) -> RunState:
        """Load a run, or keep the held one when `run_id` is the run already held.

        Keeping the state is what makes coordinator crash-resume work: the
        restarted coordinator re-sends ConfigureRun and learns the trainer's
        policy version from the answer. A re-configure of the held run with a
        different model, seed or config is refused rather than silently mixed.
        """
        if not run_id:
            raise InvalidRequest("run_id: empty")
        if not model_path:
            raise InvalidRequest("model_path: empty")
        config = parse_run_config(config_json)
        model_path = str(Path(model_path).resolve())
        held = self.run
        if held is not None and held.run_id == run_id:
            diffs = [
                name
                for name, mine, theirs in (
                    ("model_path", held.model_path, model_path),
                    ("seed", held.seed, seed),
                    ("trainer_config_json", held.config, config),
                )
                if mine != theirs
            ]
            if diffs:
                raise FailedPrecondition(
                    f"run {run_id!r} is already configured here with a different {', '.join(diffs)}; "
                    "a changed run needs a new run id"
                )
            log.info("run already configured; keeping state", extra={"fields": {
                "run_id": run_id, "policy_version": held.policy_version}})
            return held
        self.run = self._load_run(run_id, model_path, seed, config, resume_checkpoint)
        return self.run

    def _load_run(
        self, run_id: str, model_path: str, seed: int, config: TrainerRunConfig, resume_checkpoint: str
    ) -> RunState:
        if config.optimizer_offload and torch.device(self.device).type == "cpu":
            raise InvalidRequest(f"trainer_config_json.optimizer_offload: the trainer runs on device {self.device!r}, "
                                 "where the optimizer state already lives in CPU memory; offload needs an accelerator")
        configure_determinism(seed, num_threads=self.num_threads or None)
        self._apply_attention_policy(config)
        state: ckpt.TrainerState | None = None
        if resume_checkpoint:
            try:
                state = ckpt.read_state(resume_checkpoint)
            except (FileNotFoundError, ValueError) as exc:
                raise InvalidRequest(f"resume_checkpoint: {exc}") from None
            if state.run_id != run_id:
                raise InvalidRequest(f"resume_checkpoint: belongs to run {state.run_id!r}, not {run_id!r}")
        policy = run_setup.load_run_policy(model_path, resume_checkpoint, config, torch.device(self.device))
        optimizer = run_setup.build_optimizer(policy, config, torch.device(self.device))
        if state is not None:
            try:
                sharding.load_optimizer_state(policy.lm, optimizer, ckpt.read_optimizer_state(resume_checkpoint))
            except (FileNotFoundError, ValueError) as exc:
                raise InvalidRequest(f"resume_checkpoint: {exc}") from None
        # The reference is the run's initial policy, also when resuming.
        ref_model = run_setup.load_reference(model_path, config, self.device) if config.kl_coef > 0 else None
        vocab_size = int(policy.lm.get_input_embeddings().num_embeddings)
        teacher = load_teacher(config, self.device, student_vocab_size=vocab_size) if config.teacher else None
        run = RunState(
            run_id=run_id,
            model_path=model_path,
            seed=seed,
            config=config,
            policy=policy,
            ref_model=ref_model,
            optimizer=optimizer,
            policy_version=state.policy_version if state else 0,
            vocab_size=vocab_size,
            step_metrics=dict(state.step_metrics) if state else {},
            step_digests=dict(state.step_digests) if state else {},
            teacher=teacher,
        )
        log.info("run configured", extra={"fields": {
            "run_id": run_id, "model_path": model_path, "policy_version": run.policy_version,
            "resumed_from": resume_checkpoint or None, "reference_model": ref_model is not None,
            "teacher": config.teacher.model_path if config.teacher else None}})
        return run

    @staticmethod
    def _apply_attention_policy(config: TrainerRunConfig) -> None:
        from kernels.attention import REGISTRY, AttentionBackendError

        try:
            REGISTRY.set_policy(run_setup.attention_policy(config))
        except AttentionBackendError as exc:
            raise InvalidRequest(f"trainer_config_json.attention.backend: {exc}") from None

    def require_run(self, run_id: str) -> RunState:
        if self.run is None:
            raise FailedPrecondition("no run configured (call ConfigureRun first)")
        if run_id != self.run.run_id:
            raise FailedPrecondition(f"run_id: {run_id!r} is not the configured run {self.run.run_id!r}")
        return self.run

    # ------------------------------------------------------------ train step --

    def train_step(self, request: StepRequest) -> StepOutcome:
        run = self.require_run(request.run_id)
        s = request.step
        if run.policy_version == s:
            if s not in run.step_metrics:
                raise FailedPrecondition(f"step {s}: policy_version is {s} but no metrics were recorded for it")
            check_replay(s, run.step_digests.get(s), request.samples)
            return StepOutcome(s, s, dict(run.step_metrics[s]), replayed=True)
        if run.policy_version != s - 1:
            raise FailedPrecondition(
                f"step {s}: trainer holds policy_version {run.policy_version}; step {s} needs {s - 1} "
                f"(or {s} to replay)"
            )
        if not request.samples:
            raise InvalidRequest(f"header.num_trajectories: 0, but step {s} has not been applied and needs trajectories")
        self._check_token_ids(request.samples, run.vocab_size)
        check_routing(run, request.samples)
        digest = trajectories_digest(request.samples)
        metrics, sample_weights = self._apply_update(run, request.samples, step=s)
        run.policy_version = s
        # Only the step at the current policy version can be replayed: keep its metrics alone,
        # so a long run's trainer (and its checkpoints) do not grow with the step count.
        run.step_metrics = {s: metrics}
        run.step_digests = {s: digest}
        return StepOutcome(s, s, dict(metrics), replayed=False, sample_weights=sample_weights)

    @staticmethod
    def _check_token_ids(samples: list[TrainSample], vocab_size: int) -> None:
        for i, sample in enumerate(samples):
            for name, ids in (("prompt_token_ids", sample.prompt_ids), ("response_token_ids", sample.response_ids)):
                top = int(ids.max())
                if top >= vocab_size:
                    raise InvalidRequest(f"trajectory[{i}].{name}: token id {top} >= vocab size {vocab_size}")

    def _microbatches(self, run: RunState, samples: list[TrainSample]) -> list[Microbatch]:
        from kernels.attention import REGISTRY

        # The registry is process-wide and the trainer holds one run: apply
        # this run's attention policy and count what actually dispatches.
        self._apply_attention_policy(run.config)
        REGISTRY.reset_usage()
        return [mb.to(self.device) for mb in build_microbatches(samples, run.config)]

    def _backends_in_use(self, run: RunState) -> tuple[str, str]:
        from kernels.attention import REGISTRY

        if run.config.batching == "packed":
            attention = ",".join(sorted(REGISTRY.usage())) or "(none dispatched)"
        else:
            attention = f"hf:{run.config.attn_implementation} (padded)"
        return attention, self._logprob_backend(run)

    def _logprob_backend(self, run: RunState) -> str:
        from kernels.logprob.api import resolved_backend

        # It depends on the logits' dtype and device only.
        probe = torch.empty(1, run.vocab_size, dtype=run.compute_dtype, device=self.device)
        return resolved_backend(probe, temperature=run.config.temperature, with_entropy=True)

    def _parity_verdict(self, run: RunState, microbatches: list[Microbatch], logps: list[torch.Tensor],
                        samples: list[TrainSample]) -> ParityVerdict:
        attention, logprob = self._backends_in_use(run)
        return check_parity(
            torch.cat(logps).cpu(), torch.cat([mb.response_rollout_logprobs for mb in microbatches]).cpu(),
            sample_index=torch.cat([mb.response_sample_index for mb in microbatches]).cpu(),
            positions=torch.cat([mb.response_positions for mb in microbatches]).cpu(),
            attention_backend=attention, logprob_backend=logprob,
            sample_ids=[s.sample_id for s in canonical_order(samples)],
            thresholds=run.config.parity_gate, numerics=run.config.numerics,
        )

    def check_parity(self, request: StepRequest) -> ParityVerdict:
        """On-demand parity check: score the trajectories with the current weights, no update.

        Every rank of a group scores every microbatch (each forward is a collective of the shards)."""
        run, microbatches, logps = self._score(request)
        return self._parity_verdict(run, microbatches, logps, request.samples)

    def score_tokens(self, request: StepRequest) -> ScoredTokens:
        """The trainer's log-prob of every response token with the current weights, no update, beside the
        rollout's, token by token (the tensors check_parity compares)."""
        run, microbatches, logps = self._score(request)
        return ScoredTokens(
            logp=torch.cat(logps).detach().cpu(),
            rollout_logp=torch.cat([mb.response_rollout_logprobs for mb in microbatches]).cpu(),
            sample_index=torch.cat([mb.response_sample_index for mb in microbatches]).cpu(),
            positions=torch.cat([mb.response_positions for mb in microbatches]).cpu(),
            sample_ids=tuple(s.sample_id for s in canonical_order(request.samples)),
            attention_backend=self._backends_in_use(run)[0], logprob_backend=self._logprob_backend(run),
            numerics=run.config.numerics)

    def _score(self, request: StepRequest) -> tuple[RunState, list[Microbatch], list[torch.Tensor]]:
        run = self.require_run(request.run_id)
        if not request.samples:
            raise InvalidRequest("header.num_trajectories: 0, a parity check needs trajectories")
        self._check_token_ids(request.samples, run.vocab_size)
        check_routing(run, request.samples)
        microbatches = self._microbatches(run, request.samples)
        with torch.no_grad():
            logps = [run.policy(mb, temperature=run.config.temperature)[0] for mb in microbatches]
        return run, microbatches, logps

    def _my_passes(self, num_microbatches: int) -> list[int | None]:
        """Indices of this rank's microbatches, padded with None to the count every rank runs.

        Each forward and backward of a sharded model is a collective, so every
        rank makes the same number of passes; a None pass re-runs a microbatch
        with its loss scaled by zero (no gradient, no metrics)."""
        if self.dp is None:
            return list(range(num_microbatches))
        mine: list[int | None] = list(self.dp.shard(range(num_microbatches)))
        passes = -(-num_microbatches // self.dp.world_size)
        return mine + [None] * (passes - len(mine))

    def _in_order(self, local: list[R], total: int) -> list[R]:
        """Per-microbatch results of every rank, in microbatch order (this rank's alone without a group);
        their tensors cross ranks on the CPU and come back on this rank's device."""
        if self.dp is None:
            return local
        return [o.to(self.device) for o in self.dp.gather_in_order([o.to("cpu") for o in local], total)]

    def _m2po_keep(self, run: RunState, microbatches: list[Microbatch], shape: StepShape) -> torch.Tensor:
        """M2PO's keep mask over the whole step's tokens (canonical token order), from pre-update log-probs.

        The mask depends on every token of the step, and each microbatch's backward runs right after its
        forward, so the log-probs come from a no-grad forward first (one extra forward per step)."""
        cfg = run.config
        local: list[TokenDeltas] = []
        with torch.no_grad():
            for k in self._my_passes(len(microbatches)):
                mb = microbatches[0 if k is None else k]
                logp = run.policy(mb, temperature=cfg.temperature)[0]
                if k is not None:
                    local.append(TokenDeltas(keys=shape.token_keys(mb.response_sample_index, mb.response_ranks),
                                             delta=(logp - mb.response_rollout_logprobs).cpu()))
        delta = torch.empty(shape.num_tokens, dtype=torch.float32)
        for o in self._in_order(local, len(microbatches)):
            delta[o.keys.cpu()] = o.delta.cpu()
        return m2po_keep_mask(delta, cfg.policy_loss.m2po_threshold)

    def _apply_update(self, run: RunState, samples: list[TrainSample], *,
                      step: int) -> tuple[dict[str, float], tuple[tuple[str, float, float], ...]]:
        """One step: forward and backward over the microbatches, the step-1 parity gate, the optimizer
        step, and the step's metrics and each sample's IW range."""
        cfg = run.config
        microbatches = self._microbatches(run, samples)
        ordered = canonical_order(samples)
        # Every divisor of the loss is a step-wide constant (policy_loss.aggregate_loss), so summing
        # the microbatch gradients gives the same update however the step was split.
        shape = step_shape(ordered)
        sft = cfg.objective == "sft"
        keep = self._m2po_keep(run, microbatches, shape) if cfg.policy_loss.kind == "m2po" and not sft else None
        # The optimizer holds the sharded float32 masters; the module registers its unsharded
        # compute-dtype parameters while they are gathered, so never take parameters from it.
        params = [p for group in run.optimizer.param_groups for p in group["params"]]
        # On-policy distillation: the teacher scores every microbatch of this rank before the student's passes.
        teacher = (teacher_pass(run, microbatches, self._my_passes(len(microbatches)))
                   if run.teacher is not None else None)
        run.optimizer.zero_grad(set_to_none=True)
        try:
            routing = [microbatch_routing(mb, ordered) for mb in microbatches]
            outputs = self._in_order(forward_backward(run, microbatches, self._my_passes(len(microbatches)), shape,
                                                      self.device, keep, routing, teacher), len(microbatches))
            loss_value = step_loss(outputs)
            if step == 1 and not sft:  # a supervised step's tokens were not sampled: no rollout to agree with
                # Step-1 parity gate: same weights on both sides, so any
                # disagreement is a bug; refuse before the update.
                verdict = self._parity_verdict(run, microbatches, [o.logp for o in outputs], samples)
                log.info("parity gate", extra={"fields": {"run_id": run.run_id, "passed": verdict.passed,
                                                          **verdict.stats}})
                if not verdict.passed:
                    raise ParityGateFailed(verdict)
            grad_norm, lr = self._optimizer_step(run, params, step=step, loss_value=loss_value, outputs=outputs,
                                                 sample_ids=[s.sample_id for s in ordered],
                                                 staleness=mean_token_staleness(samples))
        finally:
            run.optimizer.zero_grad(set_to_none=True)
        metrics = results_step_metrics(outputs, samples, ordered, keep, loss_value=loss_value, grad_norm=grad_norm,
                                       lr=lr)
        if teacher is not None:
            metrics.update(distillation_metrics(outputs, teacher))
        return metrics, results_sample_weights(outputs, ordered)

    def _optimizer_step(self, run: RunState, params: list[torch.nn.Parameter], *, step: int, loss_value: float,
                        outputs: list[MicrobatchResult], sample_ids: list[str],
                        staleness: float) -> tuple[float, float]:
        """Clip the accumulated gradients and apply them at the step's learning rate (its schedule's, scaled
        for the tokens' mean `staleness` as configured); (grad norm, lr).
        StepFailed, with nothing applied, for a non-finite loss or gradient."""
        cfg = run.config
        grad_norm = self._clip_gradients(params, cfg.grad_clip)
        if refusal := nonfinite_update(step, loss=loss_value, grad_norm=grad_norm, sample_ids=sample_ids,
                                       tokens=[(o.nonfinite, o.sample_index, o.positions) for o in outputs]):
            raise StepFailed(refusal)
        # Set from the step every time, never carried: a param group's lr
        # restored from a checkpoint's optimizer state (or left by the
        # previous step) would otherwise survive into this update.
        lr = lr_at(step, cfg.lr, cfg.lr_schedule) * staleness_factor(staleness, cfg.lr_schedule.staleness_scaling)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        run.optimizer.step()
        run.weights_epoch += 1
        return grad_norm, lr

    @staticmethod
    def _clip_gradients(params: list[torch.nn.Parameter], grad_clip: float) -> float:
        """Global L2 norm of the (sharded) gradients, clipped to grad_clip (0: measured only)."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = sharding.full_tensor(torch.nn.utils.get_total_norm(grads))
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
        return float(norm)

    # ------------------------------------------------------------ weights --

    def weight_tensors(self, run_id: str, *, cast: bool = True) -> WeightSnapshot:
        """Every model tensor as (HF name, whole tensor in the compute dtype), tied aliases once.

        What rollout receives: the compute-dtype cast (`tensor.to(dtype)`, round
        to nearest even) of each float32 master — the very tensors forward runs
        on. Collective in a group (every rank gathers; rank 0 streams).
        `check_weights_unchanged` tells a reader whether they still hold that version.
        `cast=False`: the whole float32 masters instead, live (no copy where one rank holds them), with
        `snapshot.cast_to` the compute dtype, for a reader that casts as it copies them, under the lock.
        """
        run = self.require_run(run_id)
        sharding.reshard(run.policy)
        if run.config.lora is not None:
            # The base never changes: only the adapters (in the compute dtype forward runs on) move.
            out = [(key, t.to(run.compute_dtype)) for key, t in lora.named_adapter_tensors(run.policy.lm)]
            return WeightSnapshot(run, run.weights_epoch, run.policy_version, out if self.is_rank0 else [],
                                  lora=lora.adapter_meta(run.policy.lm, run.config.lora))
        if not cast:
            masters = list(sharding.named_master_tensors(run.policy.lm, copy=False))
            return WeightSnapshot(run, run.weights_epoch, run.policy_version, masters if self.is_rank0 else [],
                                  cast_to=run.compute_dtype)
        out = [(name, t.to(run.compute_dtype)) for name, t in sharding.named_master_tensors(run.policy.lm)]
        return WeightSnapshot(run, run.weights_epoch, run.policy_version, out if self.is_rank0 else [])

    def check_weights_unchanged(self, snapshot: WeightSnapshot) -> None:
        if self.run is not snapshot.run or snapshot.run.weights_epoch != snapshot.weights_epoch:
            raise FailedPrecondition(
                f"weights of policy_version {snapshot.policy_version} changed while they were being read"
            )

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the whole float32 master tensors by HF name, every alias included. Collective in a group."""
        run = self.require_run(self.run.run_id if self.run else "")
        sharding.reshard(run.policy)
        return {name: sharding.full_tensor(t.detach()).clone()
                for name, t in run.policy.lm.state_dict(keep_vars=True).items()}

    # ------------------------------------------------------------ checkpoints --

    def save_checkpoint(self, run_id: str, directory: str) -> tuple[Path, int]:
        """Masters (float32 safetensors, HF-loadable) and whole optimizer state; rank 0 writes. Collective."""
        run = self.require_run(run_id)
        if not directory:
            raise InvalidRequest("directory: empty")
        path = ckpt.save_run(run, directory, write=self.is_rank0)
        if self.is_rank0:
            log.info("checkpoint saved", extra={"fields": {"run_id": run_id, "directory": str(path),
                                                           "policy_version": run.policy_version}})
        return path, run.policy_version

    def load_checkpoint(self, run_id: str, directory: str) -> int:
        """Restore weights, optimizer state, policy version and step metrics of the held run."""
        run = self.require_run(run_id)
        if not directory:
            raise InvalidRequest("directory: empty")
        try:
            saved = ckpt.read_run(run, directory)  # validates every name/shape/dtype before the first copy
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidRequest(f"directory: {exc}") from None
        ckpt.restore_run(run, saved)
        log.info("checkpoint loaded", extra={"fields": {"run_id": run_id, "directory": directory,
                                                        "policy_version": run.policy_version}})
        return run.policy_version

    # ------------------------------------------------------------ info --

    def weights_digest(self) -> str:
        """sha256 over every float32 master's bytes in state-dict order. Collective in a group."""
        import hashlib

        run = self.require_run(self.run.run_id if self.run else "")
        sharding.reshard(run.policy)
        h = hashlib.sha256()
        for name, t in run.policy.lm.state_dict(keep_vars=True).items():  # one whole tensor at a time
            h.update(name.encode())
            h.update(sharding.full_tensor(t.detach()).cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def info(self) -> dict[str, object]:
        import transformers

        run = self.run
        details = {
            "device": self.device,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "logprob": "kernels.logprob.token_logprobs (backend auto)",
            "num_threads": str(torch.get_num_threads()),
            "data_parallel": str(self.dp.world_size if self.dp else 1),
            **probe_platform_details(str(self.device)),
        }
        if run is not None:
            details.update(
                attention_backend=(run.config.attention.backend or "auto") if run.config.batching == "packed"
                else f"hf:{run.config.attn_implementation} (padded)",
                logprob_backend=self._logprob_backend(run),
                dtype=run.config.dtype,
                master_dtype="float32",
                attn_implementation=run.config.attn_implementation,
                batching=run.config.batching,
                numerics=run.config.numerics,
                reference_model=str(run.ref_model is not None).lower(),
                teacher=run.config.teacher.model_path if run.config.teacher else "none",
                lora=(f"rank={run.config.lora.rank},alpha={run.config.lora.alpha}" if run.config.lora else "none"),
            )
        return {
            "run_id": run.run_id if run else "",
            "model_path": run.model_path if run else "",
            "policy_version": run.policy_version if run else -1,
            "details": details,
        }
