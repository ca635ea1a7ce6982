"""The comparison report as a PNG: one panel per metric, the runs overlaid.

matplotlib is an optional dependency (`pip install 'lockstep[plot]'`), imported only here. No pyplot:
the figure is drawn on its own Agg canvas, so nothing global (backend, open figures) is touched.

The PNG carries, in its `lockstep-panels` text chunk, the data read back from the drawn lines of each
panel (not from the report), so what the image shows can be checked against the JSON report.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

PANELS_KEY = "lockstep-panels"
COLUMNS = 3


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("compare --png needs matplotlib: pip install 'lockstep[plot]' (or pip install "
                           "matplotlib), or leave out --png") from None
    return Figure, FigureCanvasAgg


def drawn_panels(figure) -> list[dict]:
    """Each panel's title and, per line label, the (x, y) points it draws."""
    return [{"metric": ax.get_title(),
             "series": {line.get_label(): [[float(x), float(y)] for x, y in zip(line.get_xdata(), line.get_ydata())]
                        for line in ax.get_lines()}}
            for ax in figure.axes]


def plot_report(report: Mapping, path: Path):
    """Draw `report` (services.common.records.run_compare.compare_runs) to a PNG at `path`; the figure."""
    Figure, FigureCanvasAgg = _matplotlib()
    metrics = list(report["metrics"])
    rows = max(1, math.ceil(len(metrics) / COLUMNS))
    figure = Figure(figsize=(5 * min(COLUMNS, max(1, len(metrics))), 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for i, metric in enumerate(metrics):
        ax = figure.add_subplot(rows, COLUMNS, i + 1)
        entry = report["metrics"][metric]
        for label, points in entry["series"].items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label)
        verdicts = ", ".join(f"{k}: {v['verdict']}" for k, v in entry["verdicts"].items())
        ax.set_title(metric)
        ax.set_xlabel(f"step   [{verdicts}]", fontsize=7)
        ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=80, metadata={PANELS_KEY: json.dumps(drawn_panels(figure))})
    return figure
