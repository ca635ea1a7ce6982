"""`lockstep export`, `import`, `compare` and `replay-score`: runs moved between deployments as bundles,
compared, and a recorded step re-scored on this machine (the trainer's replay-score entry point, run as a
process: contract/replay_score.py).

A bundle (services.common.records.run_bundle) is written from GET /v1/runs/{id}/bundle and the run's recorded
steps; `import` checks every file against the manifest here, then the coordinator checks the documents'
digests again before it stores anything. `compare` takes run ids on the coordinator or bundle
directories (a path that is a directory is a bundle); with ids only, the coordinator computes the report
(GET /v1/compare), otherwise it is computed here by the same function.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from contract.replay_score import REFUSED_EXIT, ReplayScoreConfig, replay_score_command
from services.cli.client import CoordinatorClient
from services.common.records.run_bundle import (
    DOCUMENTS, MANIFEST, load_bundle, recorded_step, verify_bundle, write_bundle,
)
from services.common.records.run_compare import RunSeries, compare_runs, report_rows

Emit = Callable[[str], None]


def add_exchange_parsers(sub) -> None:
    e = sub.add_parser("export", help="Write a run's portable bundle (manifest with sha256s) to a new directory.")
    e.add_argument("run_id")
    e.add_argument("--out", required=True, type=Path, help="A directory that does not exist yet (or is empty).")
    i = sub.add_parser("import", help="Load a bundle into this coordinator (as an ended run with a new id).")
    i.add_argument("bundle", type=Path)
    c = sub.add_parser("compare", help="Compare runs (ids on the coordinator, or bundle directories).")
    c.add_argument("runs", nargs="+", help="Two or more run ids or bundle directories; the first is the reference.")
    c.add_argument("--window", type=int, default=None, help="Steps per window of the per-window means "
                   "(default: a quarter of the longest run).")
    c.add_argument("--json", type=Path, default=None, help="Write the report as JSON here.")
    c.add_argument("--png", type=Path, default=None, help="Write the plot (one panel per metric) here; needs "
                   "matplotlib.")
    r = sub.add_parser("replay-score", help="Re-score a bundle's recorded step on this machine's trainer (no "
                       "coordinator): log-prob differences against the recorded rollout and trainer.")
    r.add_argument("bundle", type=Path)
    r.add_argument("--step", type=int, required=True)
    r.add_argument("--checkpoint", default="", help="Checkpoint at policy version step - 1 on this machine "
                   "(not needed for step 1).")
    r.add_argument("--model", default="", help="The run's model directory on this machine (default: the "
                   "recorded path).")
    r.add_argument("--device", default="cpu")
    r.add_argument("--num-threads", type=int, default=1, help="As the recording trainer's, for bitwise results.")
    r.add_argument("--worst-tokens", type=int, default=8)


def export_run(client: CoordinatorClient, run_id: str, out: Path) -> dict:
    """The bundle of `run_id` written to `out`; its manifest."""
    b = client.bundle(run_id)
    records = {step: client.step_record(run_id, step) for step in b["step_records"]}
    docs = {"run.json": b["run"], "spec.json": b["spec"], "fingerprint.json": b["fingerprint"],
            "metrics.json": b["metrics"], "events.json": b["events"], "checkpoint.json": b["checkpoint"]}
    return write_bundle(out, run_id, docs, records)


def import_bundle(client: CoordinatorClient, directory: Path) -> dict:
    """Verify the bundle at `directory` (every file, step records included), then send its documents."""
    verify_bundle(directory)
    manifest = json.loads((directory / MANIFEST).read_bytes())
    files = {name: (directory / name).read_bytes().decode("utf-8") for name in DOCUMENTS}
    return client.import_bundle(manifest, files)


def _bundle_series(directory: Path) -> RunSeries:
    b = load_bundle(directory)
    return RunSeries(label=b.run["id"], name=b.run["name"], steps=b.metrics["steps"],
                     eval_initial=b.metrics.get("eval_initial"), fingerprint=b.fingerprint)


def _run_series(client: CoordinatorClient, run_id: str) -> RunSeries:
    run = client.run(run_id)
    source = next((e.get("source_run_id") for e in run.get("events", []) if e.get("event") == "imported"), None)
    metrics = client.metrics(run_id)
    return RunSeries(label=source or run_id, name=run["name"], steps=metrics["steps"],
                     eval_initial=metrics["eval_initial"], fingerprint=run.get("fingerprint"))


def compare(client_factory: Callable[[], CoordinatorClient], runs: list[str], window: int | None) -> dict:
    bundles = [Path(r).is_dir() for r in runs]
    if not any(bundles):
        client = client_factory()
        try:
            return client.compare(runs, window)
        finally:
            client.close()
    client = client_factory() if not all(bundles) else None
    try:
        series = [_bundle_series(Path(r)) if is_bundle else _run_series(client, r)  # type: ignore[arg-type]
                  for r, is_bundle in zip(runs, bundles)]
    finally:
        if client is not None:
            client.close()
    return compare_runs(series, window=window)


def replay_score(config: ReplayScoreConfig) -> dict:
    """The report of the trainer's replay-score entry point, run as a child process (torch and the trainer
    load there, never in the CLI). RuntimeError with the child's stderr when it fails; its stderr is passed
    on when it succeeds (warnings)."""
    done = subprocess.run(replay_score_command(sys.executable, config), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    if done.returncode == REFUSED_EXIT:  # it wrote why: "replay-score: <reason>" or a configuration error
        raise RuntimeError(done.stderr.strip() or f"replay-score: refused (exit {REFUSED_EXIT}) without a reason")
    if done.returncode != 0:
        raise RuntimeError(f"replay-score: the trainer's entry point exited with code {done.returncode}:\n"
                           f"{done.stderr.strip()}")
    sys.stderr.write(done.stderr)
    try:
        report = json.loads(done.stdout)
    except ValueError as exc:
        raise RuntimeError(f"replay-score: the trainer's entry point printed no JSON report ({exc}); its "
                           f"output:\n{done.stdout[-4000:]}") from None
    if not isinstance(report, dict):
        raise RuntimeError(f"replay-score: the trainer's entry point printed a JSON {type(report).__name__}, "
                           "not a report")
    return report


def run_exchange(args: argparse.Namespace, client_factory: Callable[[], CoordinatorClient], emit: Emit) -> int:
    if args.cmd == "export":
        client = client_factory()
        try:
            manifest = export_run(client, args.run_id, args.out)
        finally:
            client.close()
        emit(f"exported run {args.run_id} to {args.out} ({len(manifest['files'])} files)\n")
        return 0
    if args.cmd == "import":
        client = client_factory()
        try:
            run = import_bundle(client, args.bundle)
        finally:
            client.close()
        emit(f"imported {args.bundle} as run {run['id']} ({run['name']}, {run['status']})\n")
        return 0
    if args.cmd == "replay-score":
        recorded_step(args.bundle, args.step)  # a refused bundle is refused before a trainer process starts
        config = ReplayScoreConfig(
            bundle=str(args.bundle), step=args.step, checkpoint=args.checkpoint, model=args.model,
            device=args.device, num_threads=args.num_threads, worst_tokens=args.worst_tokens)
        emit(json.dumps(replay_score(config), indent=1, allow_nan=False) + "\n")
        return 0
    report = compare(client_factory, args.runs, args.window)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")  # the report's metric order
    if args.png is not None:
        from services.cli.compare_plot import plot_report

        plot_report(report, args.png)
    rows = report_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    emit(f"reference: {report['reference']}; window: {report['window']} steps\n")
    for row in rows:
        emit("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
    emit(f"noise band: {report['noise']['method']}\n")
    for label, metrics in report["separable"].items():
        emit(f"{label} vs {report['reference']}: " + (f"separable on {', '.join(metrics)}" if metrics
                                                      else "within noise on every metric") + "\n")
    return 0
