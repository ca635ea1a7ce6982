"""The comparison report's arithmetic and verdicts (pure), and its plot against its JSON."""
from __future__ import annotations

import json
import math

import pytest

from services.common.records.run_compare import (
    FLOORS,
    SEPARABLE,
    STEP_METRICS,
    UNDETERMINED,
    WITHIN,
    RunSeries,
    compare_runs,
    report_rows,
    successive_noise_sd,
    verdict,
)


def run(label: str, per_step: dict[str, list[float]], evals: dict[int, float] | None = None) -> RunSeries:
    n = len(next(iter(per_step.values())))
    steps = []
    for i in range(n):
        metrics = {k: v[i] for k, v in per_step.items()}
        if evals and (i + 1) in evals:
            metrics["eval/heldout/avg@4"] = evals[i + 1]
        steps.append({"step": i + 1, "metrics": metrics, "timings": {"train": 0.1}})
    initial = {"metrics": {"eval/heldout/avg@4": evals[0]}} if evals and 0 in evals else None
    return RunSeries(label=label, steps=steps, eval_initial=initial, name=label)


def test_successive_noise_ignores_a_steady_trend():
    assert successive_noise_sd([1.0]) is None
    assert successive_noise_sd([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(0.5))  # each step +1
    assert successive_noise_sd([5.0, 5.0, 5.0]) == 0.0


def test_verdict_band_is_k_standard_errors_or_the_floor():
    v = verdict([1.0, 2.0, 1.0, 2.0], [1.5, 2.5, 1.5, 2.5], floor=0.0)
    sd = math.sqrt(3 / (2 * 3))
    assert v["band"] == pytest.approx(3 * math.sqrt(2 * sd ** 2 / 4))
    assert v["difference"] == pytest.approx(0.5) and v["verdict"] == WITHIN
    assert verdict([1.0, 1.0, 1.0], [1.0005, 1.0005, 1.0005], floor=1e-3)["verdict"] == WITHIN
    assert verdict([1.0, 1.0, 1.0], [0.5, 0.45, 0.4], floor=1e-3)["verdict"] == SEPARABLE
    assert verdict([1.0], [0.5, 0.4], floor=0.0)["verdict"] == UNDETERMINED


def test_report_tells_a_broken_run_apart_and_a_healthy_one_not():
    base = {"reward_mean": [0.1, 0.3, 0.2, 0.4], "response_length_mean": [8, 7.5, 7.8, 7.2],
            "iw_mean": [0.9999, 1.0001, 1.0, 0.9998], "iw_max": [1.01, 1.02, 1.01, 1.015],
            "approx_kl_k3": [1e-6, 2e-6, 1e-6, 1e-6]}
    other = {**base, "reward_mean": [0.2, 0.2, 0.3, 0.3], "iw_mean": [1.0, 1.0, 1.0, 1.0]}
    broken = {**base, "iw_mean": [0.41, 0.5, 0.45, 0.48], "iw_max": [30.0, 32.0, 31.0, 33.0],
              "approx_kl_k3": [0.4, 0.3, 0.35, 0.33]}
    evals = {0: 0.25, 2: 0.3, 4: 0.3}
    report = compare_runs([run("A", base, evals), run("B", other, evals), run("C", broken, {0: 0.25, 2: 0.1, 4: 0.0})])
    assert report["reference"] == "A" and report["window"] == 1
    assert set(report["metrics"]) == {*STEP_METRICS} - {"m2po_m2"} | {"eval/heldout/avg@4"}
    assert report["separable"]["B"] == []
    assert set(report["separable"]["C"]) == {"iw_mean", "iw_max", "approx_kl_k3", "eval/heldout/avg@4"}
    e = report["metrics"]["eval/heldout/avg@4"]
    assert e["kind"] == "eval" and e["series"]["A"] == [[0, 0.25], [2, 0.3], [4, 0.3]]
    assert report["metrics"]["iw_mean"]["floor"] == FLOORS["iw_mean"]
    assert report["metrics"]["reward_mean"]["series"]["B"] == [[1, 0.2], [2, 0.2], [3, 0.3], [4, 0.3]]
    json.dumps(report, allow_nan=False)  # JSON-ready
    assert report_rows(report)[0][0] == "metric" and len(report_rows(report)) == 1 + 3 * len(report["metrics"])


def test_windows_average_consecutive_steps():
    report = compare_runs([run("A", {"response_length_mean": [8, 8, 6, 4, 2]}),
                           run("B", {"response_length_mean": [8, 8, 8, 8, 8]})], window=2)
    windows = report["metrics"]["response_length_mean"]["windows"]
    assert windows["A"] == [{"start": 1, "end": 2, "mean": 8.0}, {"start": 3, "end": 4, "mean": 5.0},
                            {"start": 5, "end": 6, "mean": 2.0}]
    assert [w["mean"] for w in windows["B"]] == [8.0, 8.0, 8.0]


def test_repeated_labels_are_told_apart_and_bad_requests_refused():
    a = run("x", {"iw_mean": [1.0, 1.0]})
    assert [r["label"] for r in compare_runs([a, a])["runs"]] == ["x", "x#2"]
    with pytest.raises(ValueError, match="runs"):
        compare_runs([a])
    with pytest.raises(ValueError, match="window"):
        compare_runs([a, a], window=0)


def test_the_png_has_one_panel_per_metric_drawing_the_json(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (requirements.lock)")
    from PIL import Image

    from services.cli.compare_plot import PANELS_KEY, plot_report

    base = {"reward_mean": [0.1, 0.3, 0.2], "iw_mean": [1.0, 0.99, 1.0]}
    report = compare_runs([run("A", base, {0: 0.1, 3: 0.2}), run("B", {**base, "iw_mean": [0.4, 0.5, 0.45]},
                                                                  {0: 0.1, 3: 0.0})])
    report = json.loads(json.dumps(report))  # what a reader of the JSON holds
    path = tmp_path / "compare.png"
    plot_report(report, path)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 0
        panels = json.loads(image.text[PANELS_KEY])
    assert [p["metric"] for p in panels] == list(report["metrics"])
    for panel in panels:
        assert panel["series"] == report["metrics"][panel["metric"]]["series"]
