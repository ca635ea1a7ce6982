"""The run comparison dashboard: generated, two single-run variables, every series following one of them.

Its metric and label names are checked with the other dashboard's in test_metric_names.py.
"""
from __future__ import annotations

import importlib.util
import json
import re

from services.common.metric_defs import step_metric_name
from services.common.records.run_compare import STEP_METRICS
from tests.conftest import REPO_ROOT
from tests.deploy.promql_names import dashboard_exprs

GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "lockstep_run_compare.json"


def _builder():
    spec = importlib.util.spec_from_file_location("build_compare_dashboard", GRAFANA / "build_compare_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_dashboard_is_generated():
    assert DASHBOARD.read_text() == _builder().render(), (
        "deploy/grafana/dashboards/lockstep_run_compare.json is stale: "
        "run .venv/bin/python deploy/grafana/build_compare_dashboard.py")


def test_two_run_variables_and_every_series_follows_one():
    board = json.loads(DASHBOARD.read_text())
    variables = board["templating"]["list"]
    assert [v["name"] for v in variables] == ["run_a", "run_b"]
    assert not any(v["multi"] or v["includeAll"] for v in variables)  # one run each
    exprs = [(where, expr) for where, expr in dashboard_exprs(DASHBOARD) if ":$" not in where]
    for where, expr in exprs:
        for m in re.finditer(r"(lockstep_[a-z0-9_]*)(\{[^}]*\})?", expr):
            assert m.group(2) in ('{run_id="$run_a"}', '{run_id="$run_b"}'), f"{where}: {expr}"
    for key in STEP_METRICS:  # each compared metric, for both runs
        for var in ("run_a", "run_b"):
            assert any(f'{step_metric_name(key)}{{run_id="${var}"}}' in e for _, e in exprs), (key, var)
    assert any("lockstep_eval_avg_at_k" in e for _, e in exprs)
