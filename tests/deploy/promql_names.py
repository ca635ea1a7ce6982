"""Which metric and label names the alert rules and the dashboard refer to.

A small PromQL reader, enough for our own expressions: it removes string
literals, label matchers, range selectors, grouping clauses and numbers, then
every identifier left is a function (followed by `(`), a keyword, or a metric
name. An identifier followed by `(` that is not a known PromQL function is
reported, so a typo in a function name cannot pass as "no metrics here".

Used by test_metric_names.py (names are defined in metric_defs) and
test_live_prometheus.py (names are exported by a live run).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.common.metric_defs import ALL_METRICS, MetricDef
from tests.conftest import REPO_ROOT

RULES_FILE = REPO_ROOT / "deploy" / "prometheus" / "rules" / "lockstep_alerts.yml"
DASHBOARD_FILES = sorted((REPO_ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))

AGGREGATORS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile",
}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_count", "histogram_sum", "histogram_fraction", "histogram_quantile", "holt_winters",
    "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10",
    "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort",
    "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh",
    "deg", "rad", "pi",
}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "NaN", "nan", "Inf", "inf"}
GROUPING = ("by", "without", "on", "ignoring", "group_left", "group_right")

# Labels every scraped series carries, plus Prometheus's own.
TARGET_LABELS = {"job", "instance"}
BUILTIN_LABELS = {"le", "alertname", "alertstate", "severity", "__name__"}

# Series Prometheus makes itself.
PROMETHEUS_SERIES = {
    "up": "scrape health of every target, written by Prometheus",
    "ALERTS": "one series per pending or firing alert, written by Prometheus's rule evaluation",
}

# SGLang's own server metrics (scraped from the SGLang child server of the
# rollout container). Names as in sglang/srt/observability/metrics_collector.py
# (sglang 0.5.23); tests/deploy/test_metric_names.py checks them against the
# installed SGLang source when its virtualenv exists.
SGLANG_METRICS = {
    "sglang:gen_throughput": "generation throughput (tokens/s) of the SGLang scheduler",
    "sglang:num_queue_reqs": "requests waiting in the SGLang scheduler queue",
}


@dataclass
class Refs:
    """Names found in a set of expressions, each with where it was seen."""

    metrics: dict[str, set[str]] = field(default_factory=dict)
    labels: dict[str, set[str]] = field(default_factory=dict)
    unknown_functions: dict[str, set[str]] = field(default_factory=dict)

    def add(self, kind: dict[str, set[str]], name: str, where: str) -> None:
        kind.setdefault(name, set()).add(where)

    def update(self, other: "Refs") -> None:
        for mine, theirs in ((self.metrics, other.metrics), (self.labels, other.labels),
                             (self.unknown_functions, other.unknown_functions)):
            for k, v in theirs.items():
                mine.setdefault(k, set()).update(v)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(" + "|".join(GROUPING) + r")\s*\(([^)]*)\)")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_IN_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def parse_expr(expr: str, where: str) -> Refs:
    refs = Refs()
    s = _STRING.sub('""', expr)
    for body in _MATCHERS.findall(s):
        for label in _LABEL_IN_MATCHER.findall(body):
            refs.add(refs.labels, label, where)
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)
    for _, body in _GROUPING.findall(s):
        for label in filter(None, (x.strip() for x in body.split(","))):
            refs.add(refs.labels, label, where)
    s = _GROUPING.sub(" ", s)
    # `group_left` / `group_right` without a label list.
    s = re.sub(r"\b(group_left|group_right)\b", " ", s)
    s = _NUMBER.sub(" ", s)
    for match in _IDENT.finditer(s):
        name = match.group(0)
        followed_by_paren = s[match.end():].lstrip().startswith("(")
        if followed_by_paren:
            if name not in FUNCTIONS | AGGREGATORS:
                refs.add(refs.unknown_functions, name, where)
        elif name not in KEYWORDS and name not in AGGREGATORS:
            refs.add(refs.metrics, name, where)
    return refs


# ------------------------------------------------------------- collections --

def rules_exprs(path: Path = RULES_FILE) -> list[tuple[str, str]]:
    """(where, expr) of every alerting and recording rule."""
    out = []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert") or rule.get("record")
            out.append((f"{path.name}:{name}", rule["expr"]))
    return out


def recording_rules(path: Path = RULES_FILE) -> set[str]:
    return {r["record"] for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "record" in r}


_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)")


def dashboard_exprs(path: Path) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and every query variable of a Grafana dashboard."""
    board = json.loads(path.read_text())
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(board.get("panels", [])):
        for t in p.get("targets", []):
            out.append((f"{path.name}:{p['title']}:{t['refId']}", t["expr"]))
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.fullmatch(q.strip())
        # label_values(metric, label) is Grafana's, not PromQL: read it as `metric` plus `by (label)`.
        out.append((f"{path.name}:${var['name']}", f"group by ({m.group(2)}) ({m.group(1)})" if m else q))
    return out


def all_refs() -> Refs:
    refs = Refs()
    for where, expr in rules_exprs() + [e for f in DASHBOARD_FILES for e in dashboard_exprs(f)]:
        refs.update(parse_expr(expr, where))
    return refs


# --------------------------------------------------------- what is defined --

def exported_names(d: MetricDef) -> set[str]:
    """Series names a prometheus_client collector built from `d` exposes."""
    if d.kind == "histogram":
        return {f"{d.name}_bucket", f"{d.name}_sum", f"{d.name}_count"}
    return {d.name}


def defined_series() -> dict[str, MetricDef]:
    return {n: d for d in ALL_METRICS for n in exported_names(d)}


def defined_labels() -> set[str]:
    return {label for d in ALL_METRICS for label in d.labels} | TARGET_LABELS | BUILTIN_LABELS
