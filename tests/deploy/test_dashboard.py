"""The Grafana dashboard and its provisioning: generated, in sync, wired to the datasource.

Metric names in the panels are checked in test_metric_names.py; here: the
committed JSON is what deploy/grafana/build_dashboard.py generates, the alert
lines drawn on panels are the rules' bounds, and the provisioning files point
where docker-compose.yml mounts things.
"""
from __future__ import annotations

import importlib.util
import json
import re

import yaml

from tests.conftest import REPO_ROOT
from tests.deploy.promql_names import RULES_FILE, dashboard_exprs

GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "lockstep_rl_health.json"


def _builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_dashboard_is_generated():
    assert DASHBOARD.read_text() == _builder().render(), (
        "deploy/grafana/dashboards/lockstep_rl_health.json is stale: "
        "run .venv/bin/python deploy/grafana/build_dashboard.py")


def test_builder_refuses_undefined_metric():
    b = _builder()
    try:
        b.m("lockstep_step_iw_mean_typo")
    except KeyError as exc:
        assert "metric_defs" in str(exc)
    else:
        raise AssertionError("build_dashboard.m() accepted a name metric_defs does not define")


def test_alert_lines_match_the_rules():
    rules = RULES_FILE.read_text()
    for key, (metric, op, value) in _builder().ALERT_LINES.items():
        # The rules write bounds like `lockstep_step_iw_max > 20`; the panel's line must be that number.
        pattern = rf"{re.escape(metric)}\s*{re.escape(op)}\s*([0-9.eE+-]+)"
        found = [float(x) for x in re.findall(pattern, rules)]
        assert value in found, f"{key}: panel draws {metric} {op} {value}, rules have {found}"


def test_panels_use_the_provisioned_datasource_and_run_variable():
    board = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert board["title"] == "Lockstep RL health"
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["run_id"]
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in board["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == uid, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid, p["title"]
    # Per-run series must follow the run picker, or picking a run shows all of them.
    for where, expr in dashboard_exprs(DASHBOARD):
        if ":$" in where:  # the run picker's own query lists every run
            continue
        for m in re.finditer(r"(lockstep_(?:step|run|weight_sync|rollout_queue|trajectories)[a-z0-9_]*)(\{[^}]*\})?", expr):
            assert m.group(2) and 'run_id=~"$run_id"' in m.group(2), f"{where}: {m.group(1)} not filtered by $run_id"


def test_panels_do_not_overlap():
    board = json.loads(DASHBOARD.read_text())
    cells = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_dashboard_provider_points_at_the_compose_mount():
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "lockstep.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    compose = yaml.safe_load((REPO_ROOT / "deploy" / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(str(v).startswith("./grafana/dashboards:") and str(v).split(":")[1] == path for v in mounts), mounts
