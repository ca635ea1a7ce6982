"""Every metric and label the alert rules and the dashboard use is defined.

The definitions are services/common/metric_defs.py (what the services export),
the rules file's own recording rules, Prometheus's `up`/`ALERTS`, and the
SGLang names listed in promql_names.SGLANG_METRICS. A renamed metric would
otherwise leave an alert that can never fire and an empty panel.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common.metric_defs import ALL_METRICS
from tests.conftest import REPO_ROOT
from tests.deploy.promql_names import (
    DASHBOARD_FILES,
    PROMETHEUS_SERIES,
    SGLANG_METRICS,
    all_refs,
    dashboard_exprs,
    defined_labels,
    defined_series,
    parse_expr,
    recording_rules,
    rules_exprs,
)


def test_reader_finds_metrics_labels_and_unknown_functions():
    # The reader itself can fail: a known expression gives exactly these names.
    refs = parse_expr(
        'sum by (instance) (rate(foo_total{job=~"a|b", x!="1e5"}[5m])) > on (run_id) group_left () '
        '(2.5e-3 * bar:baz:median) or histogram_quantile(0.5, qux_bucket) and rte(quux)',
        "t",
    )
    assert set(refs.metrics) == {"foo_total", "bar:baz:median", "qux_bucket", "quux"}
    assert set(refs.labels) == {"instance", "job", "x", "run_id"}
    assert set(refs.unknown_functions) == {"rte"}


def test_rules_and_dashboard_are_read():
    assert DASHBOARD_FILES, "no dashboard JSON under deploy/grafana/dashboards"
    assert len(rules_exprs()) >= 11  # 10 alerts + the median recording rule
    refs = all_refs()
    # Spot checks that both sources were parsed, not just one of them.
    assert any("lockstep_alerts.yml" in w for w in refs.metrics["lockstep_step_iw_mean"])
    assert any(".json" in w for w in refs.metrics["lockstep_step_iw_mean"])
    assert any("$run_id" in w for w in refs.metrics["lockstep_run_step"])


def test_every_referenced_metric_is_defined():
    refs = all_refs()
    known = set(defined_series()) | recording_rules() | set(PROMETHEUS_SERIES) | set(SGLANG_METRICS)
    unknown = {name: sorted(where) for name, where in refs.metrics.items() if name not in known}
    assert not unknown, f"referenced but defined nowhere (add to metric_defs.py or fix the name): {unknown}"


def test_no_unknown_functions():
    assert not all_refs().unknown_functions


def test_every_label_used_in_a_query_exists():
    refs = all_refs()
    unknown = {label: sorted(where) for label, where in refs.labels.items() if label not in defined_labels()}
    assert not unknown, f"labels no metric carries: {unknown}"


def test_every_step_health_metric_the_issue_names_is_on_the_dashboard():
    names = set()
    for f in DASHBOARD_FILES:
        for where, expr in dashboard_exprs(f):
            names |= set(parse_expr(expr, where).metrics)
    wanted = {
        "lockstep_step_iw_mean", "lockstep_step_iw_min", "lockstep_step_iw_max",
        "lockstep_step_logprob_abs_diff_mean", "lockstep_step_approx_kl_k3", "lockstep_step_m2po_m2",
        "lockstep_step_clip_fraction", "lockstep_step_reward_mean", "lockstep_step_eval_accuracy",
        "lockstep_step_response_length_mean", "lockstep_step_phase_seconds",
        "lockstep_rollout_generated_tokens_total", "lockstep_trainer_tokens_total",
        "lockstep_rollout_queue_depth", "lockstep_eval_avg_at_k", "lockstep_eval_pass_at_k",
    }
    assert wanted <= names, f"missing from the dashboard: {wanted - names}"


def test_labels_stay_low_cardinality():
    # Run id, service, phase, status and outcome have a handful of values each, and so do an eval's
    # set (at most 17 per run) and k (one per run), an MoE model's layer (fixed by the architecture, 48 for
    # Qwen3-30B-A3B); sample, group or token ids would create a series per sample. tracker is one of the three
    # experiment trackers a run may name. A reward's source is one of two scorer kinds, its reason one of seven
    # (services/coordinator/rewards/verdicts.py FAILURE_REASONS), cached true or false.
    allowed = {"run_id", "service", "phase", "status", "outcome", "set", "k", "layer", "tracker", "source", "reason",
               "cached"}
    wide = {d.name: set(d.labels) - allowed for d in ALL_METRICS if set(d.labels) - allowed}
    assert not wide, f"labels outside the low-cardinality set: {wide}"


def _sglang_collector_source() -> Path | None:
    for p in sorted(REPO_ROOT.glob(".venv-sglang/lib/python3*/site-packages/sglang/srt/observability/metrics_collector.py")):
        return p
    return None


@pytest.mark.parametrize("name", sorted(SGLANG_METRICS))
def test_sglang_names_exist_in_sglang(name):
    src = _sglang_collector_source()
    if src is None:
        pytest.skip("SGLang virtualenv (.venv-sglang, built by the SGLang tests) not present")
    assert re.search(rf'name="{re.escape(name)}"', src.read_text()), f"{name} not defined by {src}"
