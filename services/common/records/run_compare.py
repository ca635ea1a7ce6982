"""Side-by-side comparison of runs of one recipe: the table, and a verdict per metric. Pure.

A run is given as what GET /v1/runs/{id}/metrics answers (`eval_initial`, `steps`) plus its label and
fingerprint (`RunSeries`). The report holds, per metric:

- `series`: each run's (step, value) points, the data every view (table, plot, JSON) is drawn from;
- `windows`: each run's mean over consecutive windows of `window` steps (step metrics only), so a
  quantity stuck from start to end (a response length that does not move) shows as flat rows;
- `mean`, `noise_sd`: each run's mean, and its step-to-step noise (below);
- `verdicts`: every run after the first against the first (the reference): the difference of means,
  the noise band, and "within noise", "separable" or "undetermined".

The noise band. A run's step-to-step noise is estimated from its successive differences,
sd = sqrt(sum((x[t+1] - x[t])^2) / (2 (n - 1))) (von Neumann's estimator: a slow trend over the run,
which training has, inflates it far less than the plain standard deviation would). The standard error
of a run's mean is sd / sqrt(n); two runs are separable on a metric when their means differ by more
than K * sqrt(se_ref^2 + se_run^2) and by more than the metric's floor. The floors are the differences
numerics alone are expected to make (the step-1 parity gate's default bounds for the importance
weights and their moments; none for reward, length and evals): two platforms whose kernels round
differently are not told apart by a rounding-sized offset, however steady it is. A run with fewer than
two points of a metric has no noise estimate: its verdict is "undetermined".
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

STEP_METRICS: tuple[str, ...] = (
    "reward_mean", "response_length_mean", "iw_mean", "iw_max", "approx_kl_k3", "m2po_m2",
)
"""The per-step metrics compared (keys of the trainer's and coordinator's step metrics)."""
EVAL_METRIC = re.compile(r"^eval/[^/]+/avg@\d+$")
"""Eval metrics compared: avg@k of every eval set, at each eval step (step 0: before training)."""
NOISE_K = 3.0
FLOORS: dict[str, float] = {
    "iw_mean": 1e-3,       # the parity gate's default iw_mean_tolerance
    "iw_max": 0.05,
    "approx_kl_k3": 1e-4,
    "m2po_m2": 1e-4,
}
NOISE_METHOD = (
    "per run, the step-to-step noise sd = sqrt(sum((x[t+1]-x[t])^2) / (2 (n-1))) over its points of the metric; "
    f"a run is separable from the reference when |mean - mean_ref| > max({NOISE_K:g} * sqrt(sd_ref^2/n_ref + "
    "sd^2/n), floor[metric]); floors (rounding-sized differences numerics alone make): "
    + ", ".join(f"{k} {v:g}" for k, v in FLOORS.items()) + ", 0 for the rest; fewer than 2 points: undetermined"
)
WITHIN, SEPARABLE, UNDETERMINED = "within noise", "separable", "undetermined"


@dataclass(frozen=True)
class RunSeries:
    """One run as compared: `steps` and `eval_initial` as GET /v1/runs/{id}/metrics answers them."""

    label: str
    steps: Sequence[Mapping] = ()
    eval_initial: Mapping | None = None
    fingerprint: Mapping | None = None
    name: str = ""
    extra: Mapping = field(default_factory=dict)


def successive_noise_sd(values: Sequence[float]) -> float | None:
    """von Neumann's estimate of the step-to-step noise; None for fewer than two values."""
    if len(values) < 2:
        return None
    return math.sqrt(sum((b - a) ** 2 for a, b in zip(values, values[1:])) / (2 * (len(values) - 1)))


def verdict(ref: Sequence[float], run: Sequence[float], floor: float, k: float = NOISE_K) -> dict:
    """Whether `run`'s mean is told apart from `ref`'s, with the numbers that decided it."""
    sd_ref, sd_run = successive_noise_sd(ref), successive_noise_sd(run)
    if sd_ref is None or sd_run is None:
        return {"difference": None, "band": None, "verdict": UNDETERMINED}
    difference = sum(run) / len(run) - sum(ref) / len(ref)
    band = max(k * math.sqrt(sd_ref ** 2 / len(ref) + sd_run ** 2 / len(run)), floor)
    return {"difference": difference, "band": band, "verdict": SEPARABLE if abs(difference) > band else WITHIN}


def _finite(x: object) -> float | None:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return None
    try:
        return float(x) if math.isfinite(x) else None
    except OverflowError:  # an integer past float's range
        return None


def _series(run: RunSeries, metric: str) -> list[list[float]]:
    points = []
    if EVAL_METRIC.match(metric) and run.eval_initial:
        v = _finite((run.eval_initial.get("metrics") or {}).get(metric))
        if v is not None:
            points.append([0, v])
    for s in run.steps:
        v = _finite((s.get("metrics") or {}).get(metric))
        if v is not None:
            points.append([int(s["step"]), v])
    return points


def _windows(points: list[list[float]], window: int) -> list[dict]:
    out: dict[int, list[float]] = {}
    for step, v in points:
        out.setdefault((int(step) - 1) // window, []).append(v)
    return [{"start": w * window + 1, "end": (w + 1) * window, "mean": sum(vs) / len(vs)}
            for w, vs in sorted(out.items())]


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Labels with repeats told apart ('x', 'x#2')."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def compare_runs(runs: Sequence[RunSeries], *, window: int | None = None) -> dict:
    """The comparison report of `runs` (the first is the reference). JSON-ready: no NaN, no infinity.

    `window`: steps per window of the per-window means; None splits the longest run into 4.
    """
    if len(runs) < 2:
        raise ValueError(f"runs: compare needs at least two runs, got {len(runs)}")
    if window is not None and window < 1:
        raise ValueError(f"window: must be at least 1, got {window}")
    labels = unique_labels([r.label for r in runs])
    longest = max((int(s["step"]) for r in runs for s in r.steps), default=0)
    window = window or max(1, math.ceil(longest / 4))
    evals = sorted({m for r in runs for m in [*(k for s in r.steps for k in (s.get("metrics") or {})),
                                                  *((r.eval_initial or {}).get("metrics") or {})]
                    if EVAL_METRIC.match(m)})
    metrics: dict[str, dict] = {}
    for metric in (*STEP_METRICS, *evals):
        series = {label: _series(r, metric) for label, r in zip(labels, runs)}
        if not any(series.values()):
            continue  # a metric no run recorded (m2po_m2 before that loss was used)
        values = {label: [v for _, v in points] for label, points in series.items()}
        ref = labels[0]
        entry = {
            "kind": "eval" if EVAL_METRIC.match(metric) else "step",
            "floor": FLOORS.get(metric, 0.0),
            "series": series,
            "mean": {label: (sum(v) / len(v) if v else None) for label, v in values.items()},
            "noise_sd": {label: successive_noise_sd(v) for label, v in values.items()},
            "verdicts": {label: verdict(values[ref], values[label], FLOORS.get(metric, 0.0)) for label in labels[1:]},
        }
        if entry["kind"] == "step":
            entry["windows"] = {label: _windows(points, window) for label, points in series.items()}
        metrics[metric] = entry
    return {
        "reference": labels[0],
        "runs": [{"label": label, "name": r.name, "steps": len(r.steps), "fingerprint": r.fingerprint, **r.extra}
                 for label, r in zip(labels, runs)],
        "window": window,
        "noise": {"method": NOISE_METHOD, "k": NOISE_K, "floors": dict(FLOORS)},
        "metrics": metrics,
        "separable": {label: [m for m, e in metrics.items() if e["verdicts"][label]["verdict"] == SEPARABLE]
                      for label in labels[1:]},
    }


def report_rows(report: Mapping) -> list[list[str]]:
    """The report as a table: one row per metric and run (header first), for the command line."""
    rows = [["metric", "run", "mean", "noise sd", "windows / eval points", "vs reference"]]

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    for metric, e in report["metrics"].items():
        for label in e["series"]:
            if e["kind"] == "step":
                detail = " ".join(num(w["mean"]) for w in e["windows"][label])
            else:
                detail = " ".join(f"{int(s)}:{num(v)}" for s, v in e["series"][label])
            v = e["verdicts"].get(label)
            judged = "(reference)" if v is None else (
                v["verdict"] if v["difference"] is None else f"{v['verdict']} (d={num(v['difference'])}, "
                f"band={num(v['band'])})")
            rows.append([metric, label, num(e["mean"][label]), num(e["noise_sd"][label]), detail, judged])
    return rows
