"""The experiment trackers a run can log to: W&B, TensorBoard, MLflow, each behind one small interface.

Each backend's package is imported only when a run names it, inside the tracker's own thread
(run_tracking.py), so the coordinator starts without any of them and a missing one fails at submit with
its install hint (spec.py). Offline and local by default, under the run's directory:

  wandb        <run dir>/tracking/wandb/       offline run files (`wandb sync` uploads them later)
  tensorboard  <run dir>/tracking/tensorboard/ event files; scalars as float64 tensors, so exact
  mlflow       sqlite:///<run dir>/tracking/mlflow.db, artifacts beside it

The operator may point them elsewhere (TrackingTargets, from CoordinatorConfig): W&B online (its API key
and base URL from the coordinator's environment, as W&B reads them), an MLflow tracking server, a shared
TensorBoard log directory. A run spec never chooses a URI or a path.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.coordinator.tracking.spec import install_hint


@dataclass(frozen=True)
class TrackingTargets:
    """Where trackers write, as the operator configured it (empty: under the run's directory)."""

    wandb_mode: str = "offline"
    mlflow_tracking_uri: str = ""
    tensorboard_dir: str = ""


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    name: str
    project: str
    run_dir: Path


class Tracker(Protocol):
    """One backend. Every method may block or raise: run_tracking calls them off the step path."""

    def config(self, config: dict) -> None:
        """The run's spec and platform fingerprint, as the run's configuration."""

    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Step `step`'s metrics, keyed by tracker_key (0: the evaluation before step 1)."""

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        """A small table of step `step`'s samples."""

    def close(self) -> None:
        """Flush and end the run."""


def _import(module: str, tracker: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise RuntimeError(install_hint(tracker)) from exc


class WandbTracker:
    def __init__(self, run: RunIdentity, targets: TrackingTargets) -> None:
        wandb = _import("wandb", "wandb")
        self._wandb = wandb
        folder = run.run_dir / "tracking"
        folder.mkdir(parents=True, exist_ok=True)
        # One W&B run object per Lockstep run ("create_new"): a coordinator drives many runs in one process.
        self._run = wandb.init(project=run.project, name=run.name, id=run.run_id, dir=str(folder),
                               mode=targets.wandb_mode, resume="allow",
                               settings=wandb.Settings(reinit="create_new", console="off", save_code=False,
                                                       x_disable_stats=True, silent=True))

    def config(self, config: dict) -> None:
        self._run.config.update(config, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self._run.log({"samples": self._wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self._run.finish()


class TensorBoardTracker:
    """Written with TensorBoard's own event-file writer; scalars are rank-0 float64 tensors under the
    scalars plugin (TensorBoard plots them), since its simple_value is float32 and would round them."""

    def __init__(self, run: RunIdentity, targets: TrackingTargets) -> None:
        _import("tensorboard", "tensorboard")
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb = (event_pb2, summary_pb2, tensor_pb2, types_pb2)
        folder = (Path(targets.tensorboard_dir) / run.run_id if targets.tensorboard_dir
                  else run.run_dir / "tracking" / "tensorboard")
        folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(folder))

    def _write(self, step: int, values: list) -> None:
        event_pb2, summary_pb2, _, _ = self._pb
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                               summary=summary_pb2.Summary(value=values)))

    def _text(self, tag: str, text: str):
        _, summary_pb2, tensor_pb2, types_pb2 = self._pb
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        return summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)

    def config(self, config: dict) -> None:
        self._write(0, [self._text(f"config/{key}", "```\n" + json.dumps(value, indent=2, sort_keys=True) + "\n```")
                        for key, value in config.items()])
        self._writer.flush()

    def metrics(self, step: int, values: dict[str, float]) -> None:
        _, summary_pb2, tensor_pb2, types_pb2 = self._pb
        meta = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
        self._write(step, [summary_pb2.Summary.Value(
            tag=key, metadata=meta, tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, double_val=[value]))
            for key, value in values.items()])
        self._writer.flush()

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        def cell(v: object) -> str:
            return str(v).replace("|", "\\|").replace("\n", "\\n")
        table = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
                           *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)])
        self._write(step, [self._text("samples", table)])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MlflowTracker:
    def __init__(self, run: RunIdentity, targets: TrackingTargets) -> None:
        _import("mlflow", "mlflow")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        folder = run.run_dir / "tracking"
        folder.mkdir(parents=True, exist_ok=True)
        uri = targets.mlflow_tracking_uri or f"sqlite:///{folder / 'mlflow.db'}"
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(run.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # A local store keeps its artifacts beside it; a server decides where its own go.
            location = None if targets.mlflow_tracking_uri else (folder / "mlflow-artifacts").as_uri()
            experiment_id = self._client.create_experiment(run.project, artifact_location=location)
        # A run driven again (a coordinator restart) logs on into the MLflow run it began.
        earlier = self._client.search_runs([experiment_id], f"tags.`lockstep.run_id` = '{run.run_id}'",
                                           max_results=1)
        self._run_id = earlier[0].info.run_id if earlier else self._client.create_run(
            experiment_id, run_name=run.name, tags={"lockstep.run_id": run.run_id}).info.run_id

    def config(self, config: dict) -> None:
        for key, value in config.items():
            self._client.log_dict(self._run_id, value, f"{key}.json")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        items = [self._metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(items), 1000):  # log_batch takes at most 1000 metrics
            self._client.log_batch(self._run_id, metrics=items[i:i + 1000])

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self._client.log_dict(self._run_id, {"columns": columns, "data": rows}, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


TRACKERS: dict[str, Callable[[RunIdentity, TrackingTargets], Tracker]] = {
    "wandb": WandbTracker, "tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}
"""Tracker name (the spec's tracking.backends) -> its constructor."""
