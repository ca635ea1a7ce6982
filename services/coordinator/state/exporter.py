"""The coordinator's Prometheus collectors, built from services.common.metric_defs."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from services.common.metric_defs import (
    ASYNC_STEP_METRIC_HELP,
    COORDINATOR_METRICS,
    DISTILL_STEP_METRIC_HELP,
    EPISODE_STEP_METRIC_HELP,
    MOE_STEP_METRIC_HELP,
    STEP_METRIC_HELP,
    build_collectors,
    step_metric_name,
)

if TYPE_CHECKING:
    from services.coordinator.run.evaluation import EvalReport


class CoordinatorExporter:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._m = build_collectors(COORDINATOR_METRICS, self.registry)

    def on_step(self, run_id: str, step: int, metrics: dict, timings: dict) -> None:
        for key in (*STEP_METRIC_HELP, *ASYNC_STEP_METRIC_HELP, *EPISODE_STEP_METRIC_HELP, *MOE_STEP_METRIC_HELP,
                    *DISTILL_STEP_METRIC_HELP):
            if key in metrics:
                self._m[step_metric_name(key)].labels(run_id).set(float(metrics[key]))
        for key, value in metrics.items():
            if key.startswith("moe_routing_agreement_layer_"):
                layer = key.removeprefix("moe_routing_agreement_layer_")
                self._m["lockstep_step_moe_routing_agreement"].labels(run_id, layer).set(value)
            if key.startswith("episodes_end_"):
                self._m["lockstep_step_episodes_ended"].labels(run_id, key.removeprefix("episodes_end_")).set(value)
        self._m["lockstep_run_step"].labels(run_id).set(step)
        self._m["lockstep_run_last_step_timestamp_seconds"].labels(run_id).set(time.time())
        if timings.get("total"):
            self._m["lockstep_step_overlap_fraction"].labels(run_id).set(timings.get("overlap", 0.0) / timings["total"])
        for phase, seconds in timings.items():
            if phase == "overlap":
                continue  # not a phase: seconds during which rollout and training were both busy
            if phase == "total":
                self._m["lockstep_step_seconds"].labels(run_id).observe(seconds)
            else:
                self._m["lockstep_step_phase_seconds"].labels(run_id, phase).set(seconds)
        if "weight_sync" in timings:
            self._m["lockstep_weight_sync_seconds"].labels(run_id).set(timings["weight_sync"])

    def max_staleness(self, run_id: str, k: int) -> None:
        self._m["lockstep_run_max_staleness"].labels(run_id).set(k)

    def run_active(self, run_id: str, active: bool) -> None:
        self._m["lockstep_run_active"].labels(run_id).set(1 if active else 0)

    def on_eval(self, run_id: str, report: EvalReport) -> None:
        self._m[step_metric_name("eval_accuracy")].labels(run_id).set(report.greedy_accuracy)
        for result in report.sets:
            labels = (run_id, result.name, str(result.k))
            self._m["lockstep_eval_avg_at_k"].labels(*labels).set(result.avg_at_k)
            self._m["lockstep_eval_pass_at_k"].labels(*labels).set(result.pass_at_k)

    def trajectories(self, run_id: str, outcome: str, count: int) -> None:
        if count:
            self._m["lockstep_trajectories_total"].labels(run_id, outcome).inc(count)

    def replicas_live(self, run_id: str, live: int, configured: int) -> None:
        self._m["lockstep_rollout_replicas_live"].labels(run_id).set(live)
        self._m["lockstep_rollout_replicas_configured"].labels(run_id).set(configured)

    def trainer_recovered(self, run_id: str) -> None:
        self._m["lockstep_trainer_recoveries_total"].labels(run_id).inc()
        # The recomputed-steps series exists from the recovery on, at 0 when the trainer died right after a
        # checkpoint: a dashboard then reads "none recomputed", not "no data". Only the matched outcome: a
        # differed series is an alert's trigger and appears only with its first step.
        self._m["lockstep_steps_recomputed_total"].labels(run_id, "matched")

    def step_recomputed(self, run_id: str, matched: bool) -> None:
        self._m["lockstep_steps_recomputed_total"].labels(run_id, "matched" if matched else "differed").inc()

    def tracking_failure(self, run_id: str, tracker: str) -> None:
        self._m["lockstep_tracking_failures_total"].labels(run_id, tracker).inc()

    def queue_depth(self, run_id: str, prompts: int) -> None:
        self._m["lockstep_rollout_queue_depth"].labels(run_id).set(prompts)

    def run_counts(self, counts: dict[str, int]) -> None:
        for status, n in counts.items():
            self._m["lockstep_runs"].labels(status).set(n)

    # ------------------------------------------------------------- rewards (services/coordinator/rewards/) --
    def reward_failure(self, run_id: str, source: str, reason: str) -> None:
        self._m["lockstep_reward_failures_total"].labels(run_id, source, reason).inc()

    def reward_dropped(self, run_id: str, reason: str) -> None:
        self._m["lockstep_reward_dropped_total"].labels(run_id, reason).inc()

    def reward_scored(self, run_id: str, source: str, score: float, *, cached: bool) -> None:
        self._m["lockstep_reward_scored_total"].labels(run_id, source, "true" if cached else "false").inc()
        self._m["lockstep_reward_scores"].labels(run_id, source).observe(score)

    def reward_call(self, run_id: str, source: str, seconds: float, items: int) -> None:
        self._m["lockstep_reward_scorer_seconds"].labels(run_id, source).observe(seconds)
        self._m["lockstep_reward_batch_size"].labels(run_id, source).observe(items)

    def reward_queue_depth(self, run_id: str, items: int) -> None:
        self._m["lockstep_reward_queue_depth"].labels(run_id).set(items)
