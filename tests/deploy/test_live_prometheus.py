"""A real Prometheus scrapes a real local 3-step run.

The stack is services/local_stack.py (the services as processes on loopback,
as `make demo` runs them); Prometheus is Debian's `prometheus` binary with the
deployed scrape config (deploy/prometheus/prometheus.yml: same job names, same
rule files) pointed at the local ports and scraping every second. Checks:
- PromQL's lockstep_step_iw_mean for the run equals, bit for bit, the IW mean
  the REST API reports for step 3, and so do the last eval's avg@k and pass@k
  of each eval set (the task's held-out split and an extra JSONL set);
- every metric name the alert rules and the dashboard reference is exported
  by the live run, apart from the ones listed in MAY_BE_ABSENT with a reason;
- the healthy run trips none of the mismatch or service alerts;
- deploy/docker/healthcheck.py answers 0 for the live services, 1 for a dead port.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recipes.tiny_model import build_model_dir
from services.local_stack import LocalStack, free_port
from tests.conftest import REPO_ROOT, require
from tests.deploy.promql_names import PROMETHEUS_SERIES, RULES_FILE, SGLANG_METRICS, all_refs, rules_exprs

pytestmark = pytest.mark.slow

PROM_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
HEALTHCHECK = REPO_ROOT / "deploy" / "docker" / "healthcheck.py"

# Referenced names a healthy 3-step run with the torch engine does not export.
MAY_BE_ABSENT = {
    **{name: f"SGLang's own metric ({why}); this run uses engine=torch" for name, why in SGLANG_METRICS.items()},
    "ALERTS": PROMETHEUS_SERIES["ALERTS"] + "; a healthy run has none",
    "lockstep_step_staleness_max": "a step metric of async runs only (async.max_staleness > 0): a synchronous "
    "run's trajectories are all of version step - 1 (tests/integration/test_true_on_policy_stack.py checks "
    "the fixed-lag runs' staleness)",
    "lockstep_step_token_staleness_p95": "a step metric of async runs only (async.max_staleness > 0; "
    "tests/coordinator/run/test_streaming.py checks how it is computed)",
    "lockstep_step_trajectories_dropped_stale": "a step metric of streaming runs only (async.mode streaming; "
    "tests/integration/test_true_on_policy_stack.py checks a streaming run's)",
    "lockstep_steps_recomputed_total": "labelled counter, first exported when a lost trainer is recovered "
    "(tests/integration/recovery/test_trainer_recovery.py checks it on the coordinator's /metrics)",
    **{name: "a step metric of mixture-of-experts policies only; this run's policy is dense "
       "(tests/coordinator/state/test_moe_export.py checks how each is exported)"
       for name in ("lockstep_step_moe_dropped_tokens", "lockstep_step_moe_expert_load_max",
                    "lockstep_step_moe_expert_load_mean", "lockstep_step_moe_router_entropy",
                    "lockstep_step_moe_routing_agreement")},
    **{name: "labelled by run_id, first exported when a run's reward comes from a scorer model; this run's "
       "reward is the task's rule (tests/integration/rewards/test_hostile_scorers.py reads the failure "
       "counters from the coordinator's /metrics)"
       for name in ("lockstep_reward_batch_size_count", "lockstep_reward_batch_size_sum",
                    "lockstep_reward_dropped_total", "lockstep_reward_failures_total", "lockstep_reward_queue_depth",
                    "lockstep_reward_scored_total", "lockstep_reward_scorer_seconds_bucket",
                    "lockstep_reward_scores_bucket")},
}
MISMATCH_AND_SERVICE_ALERTS = (
    "LockstepIWMeanOutOfBand|LockstepIWMaxAboveBound|LockstepLogprobDiffAboveGate|LockstepApproxKLSpike"
    "|LockstepServiceDown|LockstepSGLangDown|LockstepRunStalled"
)


def spec(model_dir: Path, extra_set: Path) -> dict:
    return {
        "name": "live-prom",
        "model_path": str(model_dir),
        "seed": 11,
        "steps": 3,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "trainer": {"lr": 1e-3, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 16, "k": 2, "temperature": 1.0,
                 "sets": [{"name": "extra", "path": str(extra_set)}]},
    }


def live_config(stack: LocalStack, sglang_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with its targets moved to the local stack's ports."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    targets = {
        "lockstep-coordinator": f"127.0.0.1:{stack.api_port}",
        "lockstep-trainer": f"127.0.0.1:{stack.metrics_ports['trainer']}",
        "lockstep-rollout": f"127.0.0.1:{stack.metrics_ports['rollout0']}",
        # Nothing listens there: like compose while no run uses engine=sglang.
        "sglang": f"127.0.0.1:{sglang_port}",
    }
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(RULES_FILE)]
    jobs = []
    for job in cfg["scrape_configs"]:
        if job["job_name"] == "prometheus":
            continue
        job["static_configs"] = [{"targets": [targets.pop(job["job_name"])]}]
        jobs.append(job)
    assert not targets, f"deploy/prometheus/prometheus.yml lost jobs: {sorted(targets)}"
    cfg["scrape_configs"] = jobs
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=[tmp_path_factory.getbasetemp()]) as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = shutil.which("prometheus")
    require(binary is not None, "prometheus not found (apt-get install prometheus)")
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(yaml.safe_dump(live_config(stack, free_port())))
    port = free_port()
    log = open(d / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (d / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", body
    return body["data"]["result"]


def wait_for(prom: str, expr: str, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not (result := query(prom, expr)):
        assert time.monotonic() < deadline, f"no result for {expr} within {timeout_s}s"
        time.sleep(0.5)
    return result


@pytest.fixture(scope="module")
def finished_run(stack, prometheus, tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)
    extra_set = tmp_path_factory.mktemp("eval") / "extra.jsonl"
    extra_set.write_text('{"a": 12, "b": 34}\n{"a": 3, "b": 4}\n')
    client = stack.client()
    try:
        run = client.submit(spec(model_dir, extra_set))
        done = client.wait(run["id"], timeout_s=300)
        assert done["status"] == "completed", done
        steps = client.metrics(run["id"])["steps"]
    finally:
        client.close()
    # The run is over once Prometheus has scraped its end: step 3 and inactive.
    wait_for(prometheus, f'lockstep_run_step{{run_id="{run["id"]}"}} == 3')
    wait_for(prometheus, f'lockstep_run_active{{run_id="{run["id"]}"}} == 0')
    wait_for(prometheus, f'lockstep:step_seconds:median{{run_id="{run["id"]}"}}')  # a rule evaluation since
    # ...and has scraped the trainer and the rollout since the run ended: each target's scrape loop keeps its
    # own schedule, and on a loaded machine one can lag the coordinator's by seconds.
    wait_for(prometheus, 'lockstep_trainer_steps_total{outcome="trained"} >= 3', timeout_s=120)
    wait_for(prometheus, 'lockstep_rollout_requests_total', timeout_s=120)
    wait_for(prometheus, 'count(up{job=~"lockstep-trainer|lockstep-rollout"} == 1) == 2', timeout_s=120)
    return run["id"], steps


def test_promql_iw_mean_equals_the_rest_api(prometheus, finished_run):
    run_id, steps = finished_run
    assert [s["step"] for s in steps] == [1, 2, 3]
    rest = steps[2]["metrics"]["iw_mean"]
    (series,) = query(prometheus, f'lockstep_step_iw_mean{{run_id="{run_id}"}}')
    assert series["metric"]["job"] == "lockstep-coordinator"
    # prometheus_client writes repr(float) and Prometheus answers with the shortest exact decimal:
    # the value survives the trip bit for bit.
    assert float(series["value"][1]) == rest, (series, rest)
    assert abs(rest - 1) <= 1e-3  # and it is a healthy run


def test_promql_eval_avg_and_pass_at_k_equal_the_rest_api(prometheus, finished_run):
    run_id, steps = finished_run
    last = steps[2]["metrics"]
    for gauge, stat in (("lockstep_eval_avg_at_k", "avg"), ("lockstep_eval_pass_at_k", "pass")):
        series = query(prometheus, f'{gauge}{{run_id="{run_id}"}}')
        got = {(s["metric"]["set"], s["metric"]["k"]): float(s["value"][1]) for s in series}
        assert got == {(name, "2"): last[f"eval/{name}/{stat}@2"] for name in ("heldout", "extra")}, (got, last)


def test_every_referenced_metric_is_exported_by_the_live_run(prometheus, finished_run):
    names = set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])
    referenced = all_refs().metrics
    missing = sorted(n for n in referenced if n not in names and n not in MAY_BE_ABSENT)
    assert not missing, {n: sorted(referenced[n]) for n in missing}
    # The allowance list holds only names still referenced (a stale excuse would hide nothing, but rots).
    assert set(MAY_BE_ABSENT) <= set(referenced)


def test_every_scrape_target_is_up_except_the_absent_sglang(prometheus, finished_run):
    up = {r["metric"]["job"]: r["value"][1] for r in query(prometheus, "up")}
    assert up == {"lockstep-coordinator": "1", "lockstep-rollout": "1", "lockstep-trainer": "1", "sglang": "0"}


def test_a_healthy_run_trips_no_mismatch_or_service_alert(prometheus, finished_run):
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in rules) == len(rules_exprs()), "the deployed rule file was not loaded"
    firing = query(prometheus, f'ALERTS{{alertname=~"{MISMATCH_AND_SERVICE_ALERTS}"}}')
    assert firing == [], firing


def test_healthcheck_script_against_live_and_dead_services(stack):
    def check(*args: str, env: dict[str, str] | None = None) -> int:
        # The container's environment: the deployment's token in $LOCKSTEP_AUTH_TOKEN_FILE.
        env = {**os.environ, "LOCKSTEP_AUTH_TOKEN_FILE": str(stack.token_file)} if env is None else env
        return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True,
                              timeout=30, env=env).returncode

    assert check("grpc", "rollout", f"127.0.0.1:{stack.rollout_ports[0]}") == 0
    assert check("grpc", "trainer", f"127.0.0.1:{stack.trainer_port}") == 0
    assert check("http", f"{stack.api_url}/healthz") == 0
    dead = free_port()
    assert check("grpc", "trainer", f"127.0.0.1:{dead}") == 1
    assert check("http", f"http://127.0.0.1:{dead}/healthz") == 1
    # The wrong service on a live port is an error too (NOT_FOUND), not a pass.
    assert check("grpc", "trainer", f"127.0.0.1:{stack.rollout_ports[0]}") == 1
    # What the script asks is the standard grpc.health.v1 check, which any probe can ask.
    for port, name in ((stack.trainer_port, "lockstep.v1.Trainer"), (stack.rollout_ports[0], "lockstep.v1.Rollout")):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", name):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (port, service)
