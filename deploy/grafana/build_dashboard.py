"""Generate the "Lockstep RL health" Grafana dashboard from services.common.metric_defs.

    python deploy/grafana/build_dashboard.py          # rewrite the committed JSON
    python deploy/grafana/build_dashboard.py --check  # exit 1 if it is out of date

Every Lockstep metric a panel queries goes through `m()`, which refuses a name
metric_defs does not define, so a renamed metric breaks the build here rather
than leaving an empty panel in production. tests/deploy/test_dashboard.py
checks the committed JSON equals this script's output, and
tests/deploy/test_metric_names.py checks every name in it independently.

The alert thresholds drawn as lines on the mismatch panels are the bounds in
deploy/prometheus/rules/lockstep_alerts.yml (a test checks they agree).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from services.common.metric_defs import ALL_METRICS, step_metric_name  # noqa: E402

OUT = Path(__file__).resolve().parent / "dashboards" / "lockstep_rl_health.json"
UID = "lockstep-rl-health"
# Fixed uid of the provisioned datasource (provisioning/datasources/prometheus.yml).
DATASOURCE = {"type": "prometheus", "uid": "lockstep-prometheus"}
RUN = 'run_id=~"$run_id"'

# Alert bounds drawn on the panels: (metric, comparison, value) exactly as they
# appear in the rules file.
ALERT_LINES = {
    "iw_mean_low": ("lockstep_step_iw_mean", "<", 0.98),
    "iw_mean_high": ("lockstep_step_iw_mean", ">", 1.02),
    "iw_max": ("lockstep_step_iw_max", ">", 20),
    "logprob_diff": ("lockstep_step_logprob_abs_diff_mean", ">", 0.03),
    "approx_kl": ("lockstep_step_approx_kl_k3", ">", 0.05),
    "m2po_m2": ("lockstep_step_m2po_m2", ">", 0.1),
    "moe_routing_agreement": ("lockstep_step_moe_routing_agreement", "<", 0.9),
}

_DEFINED = {d.name for d in ALL_METRICS}


def m(name: str) -> str:
    """A Lockstep metric name, refused unless metric_defs defines it."""
    if name not in _DEFINED:
        raise KeyError(f"{name} is not defined in services/common/metric_defs.py")
    return name


def step(key: str) -> str:
    return m(step_metric_name(key))


# ----------------------------------------------------------------- panels --

class Layout:
    """Places panels left to right in rows of 24 grid units, ids in order."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        self.y += self.row_h
        self.x, self.row_h = 0, 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": self._id(),
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def add(self, panel: dict, w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x, self.row_h = 0, 0
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str, ref: str) -> dict:
    return {"refId": ref, "datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}


def timeseries(title: str, description: str, queries: list[tuple[str, str]], *, unit: str = "short",
               lines: list[float] = (), log_scale: bool = False, stack: bool = False,
               decimals: int | None = None, unstacked_refs: tuple[str, ...] = ()) -> dict:
    """A time series panel; `lines` draws alert bounds as red threshold lines.

    `unstacked_refs`: queries drawn dashed on their own rather than stacked (a total beside its parts).
    """
    custom: dict = {"drawStyle": "line", "lineWidth": 1, "pointSize": 4, "showPoints": "always",
                    "spanNulls": True, "fillOpacity": 10 if stack else 0,
                    "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                    "thresholdsStyle": {"mode": "line" if lines else "off"}}
    if log_scale:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    steps = [{"color": "green", "value": None}] + [{"color": "red", "value": v} for v in sorted(lines)]
    defaults: dict = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"},
                      "thresholds": {"mode": "absolute", "steps": steps}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)],
        "fieldConfig": {"defaults": defaults, "overrides": [
            {"matcher": {"id": "byFrameRefID", "options": ref},
             "properties": [{"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
                            {"id": "custom.fillOpacity", "value": 0},
                            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}
            for ref in unstacked_refs]},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
    }


def stat(title: str, description: str, expr: str, legend: str, *, mappings: list | None = None,
         steps: list | None = None) -> dict:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [target(expr, legend, "A")],
        "fieldConfig": {"defaults": {"mappings": mappings or [], "color": {"mode": "thresholds"},
                                     "thresholds": {"mode": "absolute",
                                                    "steps": steps or [{"color": "green", "value": None}]}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "value_and_name",
                    "justifyMode": "auto", "orientation": "auto"},
    }


def per_run(key: str, legend_suffix: str = "") -> tuple[str, str]:
    return f"{step(key)}{{{RUN}}}", "{{run_id}}" + legend_suffix


def build_panels() -> list[dict]:
    L = Layout()
    rate = "$__rate_interval"

    L.row("Train / inference mismatch: step 1 must show IW = 1; later steps stay near it")
    L.add(timeseries(
        "Importance weight mean",
        "Mean of exp(logp - rollout_logp) over response tokens. Healthy runs sit within 1e-3 of 1; "
        "the red lines are the LockstepIWMeanOutOfBand alert band. Seed 000's packed-attention bug gave 0.41.",
        [per_run("iw_mean")], lines=[ALERT_LINES["iw_mean_low"][2], ALERT_LINES["iw_mean_high"][2]], decimals=4))
    L.add(timeseries(
        "Importance weight min / max",
        "Extremes over response tokens (log scale). One token with max far above the red line "
        "(LockstepIWMaxAboveBound) dominates the clipped objective.",
        [per_run("iw_min", " min"), per_run("iw_max", " max")], lines=[ALERT_LINES["iw_max"][2]], log_scale=True))
    L.add(timeseries(
        "|logp - rollout_logp|",
        "Mean and max absolute log-prob difference between trainer and rollout on response tokens. "
        "The red line is the 0.03 gate on the mean (LockstepLogprobDiffAboveGate).",
        [per_run("logprob_abs_diff_mean", " mean"), per_run("logprob_abs_diff_max", " max")],
        lines=[ALERT_LINES["logprob_diff"][2]]))
    L.add(timeseries(
        "Approx KL (k3), rollout || trainer",
        "k3 estimate over response tokens. A jump means stale rollout weights or drifting trainer "
        "log-probs (LockstepApproxKLSpike; absolute ceiling drawn in red).",
        [per_run("approx_kl_k3")], lines=[ALERT_LINES["approx_kl"][2]]))
    L.add(timeseries(
        "M2PO second moment",
        "Mean of (logp - rollout_logp)^2 over response tokens, as M2PO and AReaL report it (log scale). "
        "Seed 000: 0.0022 (H100) and 0.0083 (MI325) healthy, ~17 broken; the red line is "
        "LockstepM2SecondMomentHigh.",
        [per_run("m2po_m2")], lines=[ALERT_LINES["m2po_m2"][2]], log_scale=True))
    L.add(timeseries(
        "Clip fraction / M2PO masked",
        "Fraction of response tokens whose ratio was clipped, of sequences with a clipped ratio (GSPO clips "
        "whole sequences), and of tokens M2PO masked out of the loss. Near 0 at step 1 (same weights); a "
        "steady rise means updates too large for the clip range, or rollouts drifting from the trainer.",
        [per_run("clip_fraction", " tokens clipped"), per_run("seq_clip_fraction", " sequences clipped"),
         per_run("m2po_masked_fraction", " M2PO masked")], unit="percentunit"))
    L.add(timeseries(
        "Log-ratios clamped",
        "Response tokens with a log-ratio beyond its bound, clamped before exp (trainer.policy_loss.log_ratio_bound, "
        "20 by default, for token ratios, importance weights and the KL term; gspo_log_ratio_bound, 10, for GSPO's "
        "sequence ratio); their ratios carry no gradient. 0 in a healthy run: a count here means rollouts far "
        "from the trainer's policy (stale weights, a broken engine).",
        [per_run("log_ratio_clamped_tokens")], decimals=0), w=24, h=6)

    L.row("Learning")
    L.add(timeseries(
        "Reward",
        "Mean and standard deviation of the step's rewards. Zero spread for several steps "
        "(LockstepRewardFlat) leaves GRPO with all-zero advantages.",
        [per_run("reward_mean", " mean"), per_run("reward_std", " std")]))
    L.add(timeseries(
        "Held-out accuracy",
        "Greedy accuracy on the held-out set at the last evaluation (eval.every in the run spec).",
        [per_run("eval_accuracy")], unit="percentunit"))
    L.add(timeseries(
        "Response length",
        "Mean response length in tokens. A length frozen at one value while rewards move is a "
        "symptom of the broken packed-attention run.",
        [per_run("response_length_mean")]))
    L.add(timeseries("Policy entropy", "Mean per-token entropy of the trainer policy on response tokens.",
                     [per_run("entropy")]))
    L.add(timeseries("Gradient norm", "Global gradient norm before clipping.", [per_run("grad_norm")]))
    L.add(timeseries("Loss", "Policy loss of the step (trainer.policy_loss plus KL term, aggregated as "
                     "trainer.loss_agg says).", [per_run("loss")]))
    L.add(timeseries(
        "Eval avg@k / pass@k by set",
        "At each evaluation (eval.every), per eval set: avg@k, the mean reward of eval.k samples per problem "
        "at eval.temperature, and pass@k, the fraction of problems with at least one correct sample. "
        "Set 'heldout' is the task's own held-out split; the others are the run spec's eval.sets.",
        [(f'{m("lockstep_eval_avg_at_k")}{{{RUN}}}', "{{run_id}} {{set}} avg@{{k}}"),
         (f'{m("lockstep_eval_pass_at_k")}{{{RUN}}}', "{{run_id}} {{set}} pass@{{k}}")],
        unit="percentunit"), w=24)

    L.row("Time and throughput")
    L.add(timeseries(
        "Step time by phase",
        "Wall time of each phase of the last completed step, stacked: rollout, reward, train, "
        "weight sync, eval, checkpoint. The dashed total is the run's median step time so far.",
        [(f'{m("lockstep_step_phase_seconds")}{{{RUN}}}', "{{run_id}} {{phase}}"),
         (f'lockstep:step_seconds:median{{{RUN}}}', "{{run_id}} median step")],
        unit="s", stack=True, unstacked_refs=("B",)), w=12)
    L.add(timeseries(
        "Tokens/s per service",
        "Response tokens generated per second by each rollout replica, tokens trained per second by the "
        "trainer, and SGLang's own generation throughput when a run uses engine=sglang.",
        [(f'sum by (instance) (rate({m("lockstep_rollout_generated_tokens_total")}[{rate}]))',
          "rollout {{instance}}"),
         (f'sum by (instance) (rate({m("lockstep_trainer_tokens_total")}[{rate}]))', "trainer {{instance}}"),
         ("sum by (instance) (sglang:gen_throughput)", "sglang {{instance}}")],
        unit="short"), w=12)
    L.add(timeseries(
        "Rollout queue depth",
        "Prompts dispatched to rollout and not yet returned (per run), and requests waiting in "
        "SGLang's scheduler queue. A queue that never drains with no new steps is a stalled run.",
        [(f'{m("lockstep_rollout_queue_depth")}{{{RUN}}}', "{{run_id}} dispatched"),
         ("sum by (instance) (sglang:num_queue_reqs)", "sglang queued {{instance}}")]))
    L.add(timeseries(
        "Weight sync",
        "Duration of the last weight sync to all rollout replicas (LockstepWeightSyncSlow compares it "
        "with the median step).",
        [(f'{m("lockstep_weight_sync_seconds")}{{{RUN}}}', "{{run_id}}")], unit="s"))
    L.add(timeseries(
        "Async staleness and overlap",
        "Runs with async.max_staleness K > 0: the last step's largest policy staleness (step - 1 - the version "
        "that made a trajectory) against K (LockstepStalenessAboveBound fires above it, and never should), "
        "its per-token 95th percentile, the trajectories async.mode streaming dropped for a token outside the "
        "bound, and the fraction of the step during which rollout and training were both busy.",
        [(f'{step("staleness_max")}{{{RUN}}}', "{{run_id}} staleness max"),
         (f'{step("token_staleness_p95")}{{{RUN}}}', "{{run_id}} token staleness p95"),
         (f'{step("trajectories_dropped_stale")}{{{RUN}}}', "{{run_id}} dropped stale"),
         (f'{m("lockstep_run_max_staleness")}{{{RUN}}}', "{{run_id}} K"),
         (f'{m("lockstep_step_overlap_fraction")}{{{RUN}}}', "{{run_id}} overlap fraction")]))
    L.add(timeseries(
        "Trajectories by outcome",
        "Trajectories accounted for per second, by outcome (trained, dropped with a reason). "
        "Every generated trajectory ends in exactly one outcome.",
        [(f'sum by (run_id, outcome) (rate({m("lockstep_trajectories_total")}{{{RUN}}}[{rate}]))',
          "{{run_id}} {{outcome}}")]))

    L.row("Mixture of experts (MoE policies only; docs/moe.md)")
    L.add(timeseries(
        "Routing agreement by layer",
        "Fraction of the step's tokens whose top-k experts in the rollout equal the trainer's, per MoE layer. "
        "1.0 in true_on_policy and under routing replay; the red line is LockstepMoeRoutingAgreementLow.",
        [(f'{m("lockstep_step_moe_routing_agreement")}{{{RUN}}}', "{{run_id}} layer {{layer}}")],
        unit="percentunit", lines=[ALERT_LINES["moe_routing_agreement"][2]]))
    L.add(timeseries(
        "Expert load",
        "Tokens per expert and layer over the step's positions: the busiest expert against the mean. Dropped "
        "tokens stay 0 (no capacity factor).",
        [per_run("moe_expert_load_max", " max"), per_run("moe_expert_load_mean", " mean"),
         per_run("moe_dropped_tokens", " dropped")]))
    L.add(timeseries(
        "Router entropy",
        "Mean entropy (nats) of the router's distribution over experts; ln(experts) is uniform routing, a "
        "collapse towards 0 means a few experts take every token.",
        [per_run("moe_router_entropy")]))

    L.row("Services and alerts")
    L.add(stat(
        "Targets up",
        "Prometheus scrape health per job. sglang is down whenever no run uses engine=sglang; that "
        "alone is not an alert.",
        "min by (job) (up)", "{{job}}",
        mappings=[{"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                                "1": {"text": "up", "color": "green"}}}],
        steps=[{"color": "red", "value": None}, {"color": "green", "value": 1}]), w=8, h=6)
    L.add(stat("Last completed step", "Last completed step of each run.",
               f'{m("lockstep_run_step")}{{{RUN}}}', "{{run_id}}"), w=4, h=6)
    L.add(stat(
        "Run active",
        "running: the coordinator expects more steps (LockstepRunStalled watches these); "
        "finished: completed, failed or cancelled.",
        f'{m("lockstep_run_active")}{{{RUN}}}', "{{run_id}}",
        mappings=[{"type": "value", "options": {"0": {"text": "finished", "color": "blue"},
                                                "1": {"text": "running", "color": "green"}}}]), w=4, h=6)
    L.add(stat(
        "Firing alerts",
        "Lockstep alerts firing now (see deploy/README.md for what each means).",
        'count by (alertname) (ALERTS{alertstate="firing", alertname=~"Lockstep.*"})', "{{alertname}}",
        steps=[{"color": "red", "value": None}]), w=8, h=6)
    L.add(timeseries(
        "Policy versions",
        "Policy version held by the trainer and loaded by each rollout replica; they must meet "
        "after every weight sync.",
        [(f'{m("lockstep_trainer_policy_version")}', "trainer {{instance}}"),
         (f'{m("lockstep_rollout_policy_version")}', "rollout {{instance}}")]))
    L.add(timeseries(
        "RPC outcomes",
        "Generate requests and train steps per second by outcome; anything but ok/trained needs a look "
        "in the service's logs.",
        [(f'sum by (outcome) (rate({m("lockstep_rollout_requests_total")}[{rate}]))', "generate {{outcome}}"),
         (f'sum by (outcome) (rate({m("lockstep_trainer_steps_total")}[{rate}]))', "train {{outcome}}")]))
    L.add(timeseries(
        "Rollout replicas",
        "Rollout replicas in service per run (solid) against the replicas it was configured with (dashed); "
        "the gap is evicted replicas (LockstepRolloutReplicaEvicted, LockstepRolloutNoLiveReplica at 0). "
        "Evicted replicas are probed before every step and re-admitted once synced.",
        [(f'{m("lockstep_rollout_replicas_live")}{{{RUN}}}', "{{run_id}} live"),
         (f'{m("lockstep_rollout_replicas_configured")}{{{RUN}}}', "{{run_id}} configured")],
        decimals=0, unstacked_refs=("B",)))

    L.row("Rewards from models (reward model, judge: docs/rewards.md)")
    L.add(timeseries(
        "Reward failures by reason",
        "Score attempts per second that gave no reward, by source and reason (unparsable, non_finite, "
        "out_of_range, malformed, timeout, scorer_unavailable, scorer_error), and samples dropped unscored after "
        "reward.max_attempts. LockstepRewardFailureRateHigh fires above a fifth of attempts.",
        [(f'sum by (run_id, source, reason) (rate({m("lockstep_reward_failures_total")}{{{RUN}}}[{rate}]))',
          "{{run_id}} {{source}} {{reason}}"),
         (f'sum by (run_id, reason) (rate({m("lockstep_reward_dropped_total")}{{{RUN}}}[{rate}]))',
          "{{run_id}} dropped {{reason}}")]))
    L.add(timeseries(
        "Scorer latency and batch size",
        "Median Score call latency per source (seconds) and mean items per call; the queue is the samples "
        "waiting for a scorer's answer.",
        [(f'histogram_quantile(0.5, sum by (run_id, source, le) (rate({m("lockstep_reward_scorer_seconds")}_bucket'
          f'{{{RUN}}}[{rate}])))', "{{run_id}} {{source}} p50 s"),
         (f'sum by (run_id, source) (rate({m("lockstep_reward_batch_size")}_sum{{{RUN}}}[{rate}])) / sum by '
          f'(run_id, source) (rate({m("lockstep_reward_batch_size")}_count{{{RUN}}}[{rate}]))',
          "{{run_id}} {{source}} items/call"),
         (f'{m("lockstep_reward_queue_depth")}{{{RUN}}}', "{{run_id}} queued")]))
    L.add(timeseries(
        "Verdict distribution",
        "Accepted scores per second by bucket upper bound (the judge's or reward model's verdicts); a "
        "distribution collapsing onto one bucket leaves GRPO without signal.",
        [(f'sum by (le) (rate({m("lockstep_reward_scores")}_bucket{{{RUN}}}[{rate}]))', "<= {{le}}")]))
    return L.panels


def build_dashboard() -> dict:
    run_var = {
        "name": "run_id", "label": "Run", "type": "query", "datasource": DATASOURCE,
        "query": {"query": f'label_values({m("lockstep_run_step")}, run_id)', "refId": "run_id"},
        "definition": f'label_values({m("lockstep_run_step")}, run_id)',
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*", "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }
    return {
        "uid": UID,
        "title": "Lockstep RL health",
        "description": "Train/inference mismatch health of Lockstep GRPO runs. Generated by "
                       "deploy/grafana/build_dashboard.py from services/common/metric_defs.py; do not edit by hand.",
        "tags": ["lockstep", "rl"],
        "editable": False,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": [run_var]},
        "panels": build_panels(),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python deploy/grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
