"""RunTracking's guarantees, with stand-in trackers (a unit test of the queueing logic; the real trackers are
checked on the real stack in tests/integration/tracking/): calls arrive in order, a raising, unbuildable or
hanging tracker costs the caller nothing and every lost call is counted, and names follow Prometheus."""
from __future__ import annotations

import json
import threading
import time

import pytest

from services.coordinator.tracking.run_tracking import RunTracking, tracker_key, tracker_values
from services.coordinator.tracking.spec import TrackingSpec
from services.coordinator.tracking.trackers import RunIdentity, TrackingTargets


class Recording:
    def __init__(self, run, targets) -> None:
        self.calls: list = []
        INSTANCES.append(self)

    def config(self, config):
        self.calls.append(("config", config))

    def metrics(self, step, values):
        self.calls.append(("metrics", step, values))

    def samples(self, step, columns, rows):
        self.calls.append(("samples", step, rows))

    def close(self):
        self.calls.append(("close",))


class Raising(Recording):
    def metrics(self, step, values):
        raise ValueError("down")


class Unbuildable:
    def __init__(self, run, targets) -> None:
        raise ImportError("no such package")


RELEASE = threading.Event()


class Hanging(Recording):
    def metrics(self, step, values):
        RELEASE.wait()


INSTANCES: list[Recording] = []


def tracking(tmp_path, makers: dict, *, failures: list, every: int = 2, timeout_s: float = 30.0,
             queue_size: int = 64) -> RunTracking:
    spec = TrackingSpec.model_construct(backends=list(makers), project="p", samples_every=every, samples_rows=1)
    samples = {2: [{"sample_id": "g/0", "prompt": "p", "response": "r", "reward": 1.0, "advantage": 0.5,
                    "length": 1, "finish_reason": "stop"}, {"sample_id": "g/1"}]}
    return RunTracking(RunIdentity("abc", "n", "p", tmp_path), spec, TrackingTargets(), last_step=3,
                       read_samples=samples.get, on_failure=lambda t, why: failures.append((t, why)),
                       call_timeout_s=timeout_s, queue_size=queue_size, trackers=makers)


def test_names_are_the_prometheus_names_with_labels_as_path_segments():
    assert tracker_key("iw_mean") == "lockstep_step_iw_mean"
    assert tracker_key("eval/heldout/pass@4") == "lockstep_eval_pass_at_k/heldout/4"
    assert tracker_key("episodes_end_max_turns") == "lockstep_step_episodes_ended/max_turns"
    assert tracker_values({"loss": 1, "x": "text"}) == {"lockstep_step_loss": 1.0}


def test_calls_arrive_in_order_and_samples_every_n_steps_and_at_the_last(tmp_path):
    INSTANCES.clear()
    failures: list = []
    t = tracking(tmp_path, {"wandb": Recording}, failures=failures)
    t.config({"run_spec": {}})
    t.eval_initial({"eval_accuracy": 0.25})
    for step in (1, 2, 3):
        t.step(step, {"loss": float(step)})
    t.close()
    (rec,) = INSTANCES
    assert rec.calls == [("config", {"run_spec": {}}), ("metrics", 0, {"lockstep_step_eval_accuracy": 0.25}),
                         ("metrics", 1, {"lockstep_step_loss": 1.0}), ("metrics", 2, {"lockstep_step_loss": 2.0}),
                         ("samples", 2, [[2, "g/0", "p", "r", 1.0, 0.5, 1, "stop"]]),
                         ("metrics", 3, {"lockstep_step_loss": 3.0}), ("close",)]  # step 3 has no samples kept
    assert failures == []


def test_a_raising_or_unbuildable_tracker_is_counted_per_lost_call_and_the_others_carry_on(tmp_path):
    INSTANCES.clear()
    failures: list = []
    t = tracking(tmp_path, {"wandb": Raising, "mlflow": Unbuildable, "tensorboard": Recording}, failures=failures,
                 every=0)
    for step in (1, 2):
        t.step(step, {"loss": 0.5})
    assert t.close() == {"wandb": True, "mlflow": False, "tensorboard": True}  # raising calls do not end a tracker
    assert [c[0] for c in INSTANCES[-1].calls] == ["metrics", "metrics", "close"]
    by = {name: [why for n, why in failures if n == name] for name in ("wandb", "mlflow", "tensorboard")}
    assert len(by["wandb"]) == 2 and all("ValueError('down')" in why for why in by["wandb"])
    assert by["mlflow"][0].startswith("cannot start: ImportError") and len(by["mlflow"]) == 3  # start, 2 steps
    assert by["tensorboard"] == []


def test_a_hanging_tracker_is_given_up_and_neither_blocks_the_caller_nor_the_end(tmp_path):
    RELEASE.clear()
    failures: list = []
    t = tracking(tmp_path, {"wandb": Hanging}, failures=failures, every=0, timeout_s=0.2, queue_size=2)
    t.step(1, {"loss": 0.5})  # hangs in the tracker's thread
    while t.workers[0]._busy_since is None:
        time.sleep(0.01)
    t.step(2, {"loss": 0.5})
    t.step(3, {"loss": 0.5})
    t.step(4, {"loss": 0.5})  # the queue (2) is full: dropped and counted, the caller does not wait
    assert [why for _, why in failures] == ["step 4 metrics dropped: queue full"]
    time.sleep(0.3)  # past the call timeout
    t.step(5, {"loss": 0.5})
    assert t.close() == {"wandb": False}
    assert [why.split(":")[0] for _, why in failures[1:]] == [
        "a call has not returned in 0.2 s; tracker given up", "step 5 metrics dropped"]
    RELEASE.set()


def test_a_spec_names_each_tracker_once_and_only_installed_ones(monkeypatch):
    with pytest.raises(ValueError, match="named twice"):
        TrackingSpec.model_validate({"backends": ["wandb", "wandb"]})
    with pytest.raises(ValueError, match="Input should be 'wandb', 'tensorboard' or 'mlflow'"):
        TrackingSpec.model_validate({"backends": ["swanlab"]})
    from services.coordinator.tracking import spec
    monkeypatch.setitem(spec.TRACKER_PACKAGES, "mlflow", (("mlflow", "no_such_module_for_lockstep"),
                                                          spec.TRACKER_PACKAGES["mlflow"][1]))
    with pytest.raises(ValueError, match=r"pip install 'mlflow-skinny==3.18.0' 'SQLAlchemy==2.1.9'"):
        TrackingSpec.model_validate({"backends": ["mlflow"]})


def test_samples_tables_need_kept_samples(tmp_path):
    from recipes.char_tokenizer import save_char_tokenizer
    from services.coordinator.run_spec import RunSpecError, parse_run_spec

    save_char_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    body = {"name": "t", "model_path": str(tmp_path), "steps": 1, "task": {"name": "arithmetic"},
            "samples": {"keep_steps": 0}, "tracking": {"backends": ["tensorboard"], "samples_every": 5}}
    with pytest.raises(RunSpecError) as err:
        parse_run_spec(json.dumps(body).encode())
    assert [f["field"] for f in err.value.fields] == ["tracking.samples_every"]
    body["tracking"]["samples_every"] = 0
    assert parse_run_spec(json.dumps(body).encode()).samples.keep_steps == 0
