"""The one definition of every Prometheus metric Lockstep exports.

Services create their collectors from these definitions; alert rules and the
Grafana dashboard reference the same names (a test checks that every name they
use is exported by a live run). Labels stay low-cardinality: run id and
service, never sample or group ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class MetricDef:
    name: str            # full Prometheus name, always `lockstep_` prefixed
    kind: str            # "gauge" | "counter" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only; None = prometheus_client defaults


# Per-step training health, exported by the coordinator for each run
# (`lockstep_step_<key>`); <key> is the key in the step metrics dict.
STEP_METRIC_HELP: dict[str, str] = {
    "loss": "Policy loss of the step (trainer.policy_loss plus KL term, aggregated as trainer.loss_agg says).",
    "iw_mean": "Mean importance weight exp(logp - rollout_logp) over response tokens.",
    "iw_min": "Minimum importance weight over response tokens.",
    "iw_max": "Maximum importance weight over response tokens.",
    "logprob_abs_diff_mean": "Mean |logp - rollout_logp| over response tokens.",
    "logprob_abs_diff_max": "Max |logp - rollout_logp| over response tokens.",
    "approx_kl_k3": "k3 estimate of KL(rollout || trainer) over response tokens.",
    "m2po_m2": "M2PO second moment: mean of (logp - rollout_logp)^2 over response tokens.",
    "clip_fraction": "Fraction of response tokens whose ratio was clipped.",
    "seq_clip_fraction": "Fraction of sequences with a clipped ratio on any token (under trainer.policy_loss.kind "
    "gspo: sequences whose sequence-level ratio was clipped).",
    "m2po_masked_fraction": "Fraction of response tokens M2PO masked out of the loss to bring their second moment "
    "down to trainer.policy_loss.m2po_threshold (0 unless the kind is m2po).",
    "log_ratio_clamped_tokens": "Response tokens with a log-ratio beyond its bound, clamped before exp "
    "(trainer.policy_loss.log_ratio_bound for token ratios and the KL term, gspo_log_ratio_bound for GSPO's "
    "sequence ratio); their ratios carry no gradient. Above 0, the policy is far from the rollout's.",
    "grad_norm": "Global gradient norm before clipping.",
    "lr": "Learning rate applied by the step's optimizer update.",
    "is_weight_mean": "Mean mismatch-correction weight applied to token losses (1 with trainer.mismatch_correction.mode none).",
    "is_affected_fraction": "Fraction of response tokens whose correction weight was truncated or masked.",
    "entropy": "Mean per-token entropy of the trainer policy on response tokens.",
    "kl_ref": "Mean k3 KL to the reference policy (0 when disabled).",
    "reward_mean": "Mean reward of the step's samples.",
    "reward_std": "Standard deviation of rewards in the step.",
    "response_length_mean": "Mean response length in tokens.",
    "tokens_response": "Response tokens trained on in the step.",
    "tokens_total": "Prompt plus response tokens in the step.",
    "eval_accuracy": "Held-out greedy accuracy (last evaluation).",
}
# Per-step policy staleness of a run with async.max_staleness > 0 (the coordinator computes these from the
# version each replica reported; a synchronous run has none): staleness of a trajectory of step s made by
# version v is s - 1 - v.
ASYNC_STEP_METRIC_HELP: dict[str, str] = {
    "staleness_max": "Largest policy staleness (step - 1 - generating version) over the step's trajectories; "
    "never above the run's async.max_staleness.",
    "staleness_mean": "Mean policy staleness (step - 1 - generating version) over the step's trajectories.",
    "token_staleness_p50": "Median policy staleness (step - 1 - the version that sampled it) over the step's "
    "trained response tokens.",
    "token_staleness_p95": "95th percentile (nearest rank) of the step's per-token policy staleness.",
    "token_staleness_max": "Largest per-token policy staleness of the step; never above async.max_staleness.",
    "trajectories_dropped_stale": "Trajectories of the step refused before training because a token's version "
    "was outside [step - 1 - async.max_staleness, step - 1] (async.mode streaming).",
    "weight_sync_beside_training": "1 when the step's weight sync (the replicas to step - 1) ran while the "
    "step trained, from the copy of step - 1 the trainer kept; 0 when it ran before training.",
}
# Per-step numbers of a run whose task is multi-turn (services/coordinator/tasks/episodic.py); a single-turn
# run has none.
EPISODE_STEP_METRIC_HELP: dict[str, str] = {
    "episode_turns_mean": "Mean model turns per episode of the step.",
    "episode_turns_max": "Most model turns in one episode of the step.",
    "episode_tokens_mean": "Mean tokens per episode of the step (prompt, model turns and observations).",
    "episode_model_token_fraction": "Fraction of the step's response tokens the model sampled (the rest are "
    "environment observations, outside the loss).",
    "episode_tool_calls_mean": "Mean tool calls per episode of the step (turns the environment counted as one).",
    "episode_tool_errors": "Tool calls of the step's episodes that failed (a refused calculator expression).",
}
# Per-step routing of a mixture-of-experts policy (services/trainer/model/moe.py; docs/moe.md); a dense run has
# none. Routing agreement per layer is lockstep_step_moe_routing_agreement{layer}.
MOE_STEP_METRIC_HELP: dict[str, str] = {
    "moe_expert_load_max": "Most tokens routed to one expert in one layer over the step's positions.",
    "moe_expert_load_mean": "Mean tokens per expert and layer over the step's positions (positions x top-k / "
    "experts).",
    "moe_dropped_tokens": "Token slots dropped by an expert capacity limit; always 0 (no capacity factor).",
    "moe_router_entropy": "Mean entropy (nats) of the router's expert distribution over positions and layers.",
    "moe_routing_agreement_min": "Lowest over layers of the fraction of tokens whose top-k experts in the rollout "
    "equal the trainer's (1.0 in true_on_policy and under routing replay); only when trajectories carry experts.",
}
# Per-step numbers of an on-policy distillation run (the run spec's `teacher`; docs/distillation.md); a run
# without a teacher has none.
DISTILL_STEP_METRIC_HELP: dict[str, str] = {
    "distill_reverse_kl": "Mean over the step's response tokens of student logp - teacher logp (the student's "
    "log-prob being the rollout's): a one-sample estimate of the reverse KL(student || teacher) per token.",
    "distill_argmax_agreement": "Fraction of the step's response positions where the teacher's and the "
    "student's (pre-update) most likely tokens are the same.",
    "teacher_scoring_seconds": "Wall time the teacher spent scoring the step's sampled tokens in the trainer "
    "(rank 0's microbatches).",
}
STEP_PHASES = ("rollout", "reward", "dynamic_sampling", "train", "weight_sync", "eval", "checkpoint")


def step_metric_name(key: str) -> str:
    return f"lockstep_step_{key}"


COORDINATOR_METRICS: tuple[MetricDef, ...] = (
    *(MetricDef(step_metric_name(k), "gauge", h, ("run_id",)) for k, h in STEP_METRIC_HELP.items()),
    *(MetricDef(step_metric_name(k), "gauge", h, ("run_id",)) for k, h in ASYNC_STEP_METRIC_HELP.items()),
    *(MetricDef(step_metric_name(k), "gauge", h, ("run_id",)) for k, h in EPISODE_STEP_METRIC_HELP.items()),
    *(MetricDef(step_metric_name(k), "gauge", h, ("run_id",)) for k, h in MOE_STEP_METRIC_HELP.items()),
    MetricDef("lockstep_step_moe_routing_agreement", "gauge", "Fraction of the step's tokens whose top-k experts "
              "in the rollout equal the trainer's, per MoE layer (only when trajectories carry experts).",
              ("run_id", "layer")),
    *(MetricDef(step_metric_name(k), "gauge", h, ("run_id",)) for k, h in DISTILL_STEP_METRIC_HELP.items()),
    MetricDef("lockstep_step_episodes_ended", "gauge", "Episodes of the last step that ended as `outcome` "
              "(done, max_turns, max_episode_tokens, or an environment failure: env_error, env_timeout, "
              "env_crashed, observation_too_large, observation_not_utf8, bad_result).", ("run_id", "outcome")),
    MetricDef("lockstep_run_max_staleness", "gauge", "The run's async.max_staleness K (0 for a synchronous run).",
              ("run_id",)),
    MetricDef("lockstep_step_overlap_fraction", "gauge",
              "Fraction of the last step's wall time during which rollout and training were both busy (0 in the "
              "synchronous loop).", ("run_id",)),
    MetricDef("lockstep_run_step", "gauge", "Last completed step of the run.", ("run_id",)),
    MetricDef("lockstep_run_last_step_timestamp_seconds", "gauge", "Unix time the last step completed.", ("run_id",)),
    MetricDef("lockstep_step_phase_seconds", "gauge", "Wall time of each phase of the last step.", ("run_id", "phase")),
    # Default buckets stop at 10 s; real steps take seconds to an hour.
    MetricDef("lockstep_step_seconds", "histogram", "Wall time of whole steps.", ("run_id",),
              buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)),
    MetricDef("lockstep_run_active", "gauge",
              "1 while the run is running (steps are expected), 0 once it completed, failed, was cancelled "
              "or paused.",
              ("run_id",)),
    MetricDef("lockstep_runs", "gauge", "Runs known to the coordinator by status.", ("status",)),
    MetricDef("lockstep_trajectories_total", "counter", "Trajectories accounted for by outcome.", ("run_id", "outcome")),
    MetricDef("lockstep_rollout_queue_depth", "gauge", "Prompts dispatched to rollout and not yet returned.", ("run_id",)),
    MetricDef("lockstep_rollout_replicas_live", "gauge",
              "Rollout replicas in service for the run (the others were evicted after they stopped answering).",
              ("run_id",)),
    MetricDef("lockstep_rollout_replicas_configured", "gauge",
              "Rollout replicas the coordinator was configured with (live + evicted).", ("run_id",)),
    MetricDef("lockstep_trainer_recoveries_total", "counter",
              "Times the run's trainer was lost and resumed from the run's last checkpoint.", ("run_id",)),
    MetricDef("lockstep_steps_recomputed_total", "counter",
              "Steps recomputed after a trainer recovery, by whether they reproduced their record bit for bit "
              "(outcome matched or differed).", ("run_id", "outcome")),
    MetricDef("lockstep_weight_sync_seconds", "gauge", "Duration of the last weight sync to all rollout replicas.", ("run_id",)),
    MetricDef("lockstep_tracking_failures_total", "counter",
              "Calls to an experiment tracker (the run spec's tracking.backends) that failed, timed out or were "
              "dropped; the run goes on without them.", ("run_id", "tracker")),
    MetricDef("lockstep_reward_failures_total", "counter",
              "Score attempts of a sample that gave no reward, by scorer source and reason (unparsable, non_finite, "
              "out_of_range, malformed, timeout, scorer_unavailable, scorer_error); each is retried up to "
              "reward.max_attempts.", ("run_id", "source", "reason")),
    MetricDef("lockstep_reward_dropped_total", "counter",
              "Samples dropped from their step unscored after reward.max_attempts, by their last failure reason.",
              ("run_id", "reason")),
    MetricDef("lockstep_reward_scored_total", "counter", "Samples given a score by a scorer model, by source "
              "and whether the score came from the cache.", ("run_id", "source", "cached")),
    MetricDef("lockstep_reward_scorer_seconds", "histogram", "Latency of one Score call to a scorer replica.",
              ("run_id", "source"), buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)),
    MetricDef("lockstep_reward_batch_size", "histogram", "Items per Score call.", ("run_id", "source"),
              buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)),
    MetricDef("lockstep_reward_queue_depth", "gauge", "Samples waiting for a scorer's answer.", ("run_id",)),
    MetricDef("lockstep_reward_scores", "histogram", "Accepted scores (the verdict distribution), by source.",
              ("run_id", "source"), buckets=(-10, -5, -2, -1, -0.5, 0, 0.5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100)),
    MetricDef("lockstep_eval_avg_at_k", "gauge",
              "avg@k of the last evaluation on an eval set: the mean reward of k samples per problem (eval.k at "
              "eval.temperature), averaged over the set's problems. set 'heldout' is the task's held-out split.",
              ("run_id", "set", "k")),
    MetricDef("lockstep_eval_pass_at_k", "gauge",
              "pass@k of the last evaluation on an eval set: the fraction of its problems with at least one of "
              "k samples correct (reward at least the task's success reward, 1.0).", ("run_id", "set", "k")),
)

ROLLOUT_METRICS: tuple[MetricDef, ...] = (
    MetricDef("lockstep_rollout_requests_total", "counter", "Generate requests by outcome.", ("service", "outcome")),
    MetricDef("lockstep_rollout_generated_tokens_total", "counter", "Response tokens generated.", ("service",)),
    MetricDef("lockstep_rollout_generate_seconds", "histogram", "Generate request latency.", ("service",)),
    MetricDef("lockstep_rollout_policy_version", "gauge", "Policy version of the loaded weights.", ("service",)),
    MetricDef("lockstep_rollout_weight_updates_total", "counter", "Weight update calls by outcome (a LoadWeights prefetch, which applies nothing, included).", ("service", "outcome")),
    MetricDef("lockstep_rollout_prefill_tokens_total", "counter",
              "Tokens the embedded engine ran through prefill forwards (K/V computed: prompts, multi-turn "
              "contexts, recomputation after preemption).", ("service",)),
    MetricDef("lockstep_rollout_reused_prefix_tokens_total", "counter",
              "Context tokens of multi-turn episode turns whose K/V the embedded engine kept from the episode's "
              "previous turn instead of prefilling them again.", ("service",)),
    MetricDef("lockstep_rollout_kv_reuse_misses_total", "counter",
              "Episode turns that re-prefilled their whole context although the previous turn's K/V had been "
              "kept, by why it was gone (outcome evicted: pool pressure; weights: they changed; released: the pool "
              "was freed; not_a_prefix: the context does not extend it).",
              ("service", "outcome")),
    MetricDef("lockstep_scorer_items_total", "counter", "Items a scorer replica (role scorer) scored.", ("service",)),
    MetricDef("lockstep_scorer_seconds", "histogram", "Score call latency on a scorer replica.", ("service",)),
)

TRAINER_METRICS: tuple[MetricDef, ...] = (
    MetricDef("lockstep_trainer_steps_total", "counter", "Train steps by outcome.", ("service", "outcome")),
    MetricDef("lockstep_trainer_tokens_total", "counter", "Tokens processed by train steps.", ("service",)),
    MetricDef("lockstep_trainer_step_seconds", "histogram", "Train step latency.", ("service",)),
    MetricDef("lockstep_trainer_policy_version", "gauge", "Policy version held by the trainer.", ("service",)),
)

_KINDS = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


def build_collectors(defs: tuple[MetricDef, ...], registry: CollectorRegistry) -> dict[str, object]:
    """Instantiate collectors for `defs` in `registry` (one registry per service instance)."""
    out: dict[str, object] = {}
    for d in defs:
        name = d.name[: -len("_total")] if d.kind == "counter" and d.name.endswith("_total") else d.name
        kwargs = {"buckets": d.buckets} if d.buckets is not None else {}
        out[d.name] = _KINDS[d.kind](name, d.help, d.labels, registry=registry, **kwargs)
    return out


ALL_METRICS: tuple[MetricDef, ...] = COORDINATOR_METRICS + ROLLOUT_METRICS + TRAINER_METRICS
