"""Packed sequences attending across boundaries, end to end: in `numerics: fast` a
run whose attention ignores sequence boundaries is stopped at step 1 by the
parity gate, through the real services.

The trainer loads a test-only attention plugin (tests.support.boundary_blind_plugin)
that registers a boundary-blind backend *claiming* to honour boundaries, so the
registry cannot refuse it: only the gate stands between it and a garbage update.

The same stack serves the cross-run comparison at the end of this module: with the gate loosened,
the boundary-blind run trains, and `lockstep compare` must tell it apart from a healthy run on IW while
calling two healthy runs of different numerics within noise; the runs are exported as bundles and
imported into a second coordinator with its own Redis, where the report must come out the same.
"""
from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.common.auth import TOKEN_FILE_ENV
from services.common.records.fingerprint import CPUINFO_FILE, parse_cpu_model
from services.common.records.run_bundle import DOCUMENTS
from services.local_stack import LocalStack
from tests.support.boundary_blind_attention import NAME as BLIND

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A larger init than Qwen3's default so each token's distribution depends on
    # its context, which is what leaking context across sequences corrupts.
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"LOCKSTEP_TRAINER_ATTENTION_PLUGINS": "tests.support.boundary_blind_plugin"}
    with LocalStack(tmp_path_factory.mktemp("stack"), extra_env=env, path_roots=[tmp_path_factory.getbasetemp()]) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    c = stack.client()
    yield c
    c.close()


def spec(model_dir: Path, backend: str) -> dict:
    return {
        "name": f"gate-{backend}",
        "model_path": str(model_dir),
        "seed": 3,
        "steps": 2,
        # The fast mode, where rollout and trainer agree up to rounding: the gate is the safety net there.
        "numerics": "fast",
        "task": {"name": "arithmetic", "options": {"digits": 3, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 8}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, "batching": "packed", "attention": {"backend": backend}},
        "eval": {"every": 0, "heldout_size": 8},
    }


def test_boundary_blind_attention_fails_the_run_at_step_1_naming_it(client, model_dir):
    run = client.submit(spec(model_dir, BLIND))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "failed", done
    error = done["error"]
    print(error)  # the diagnostic a user sees, kept in the test log
    assert "step-1 parity gate FAILED" in error
    assert f"attention backend: {BLIND}" in error
    assert "logprob backend: reference" in error
    assert "worst tokens" in error and "position" in error
    assert client.metrics(run["id"])["steps"] == []  # nothing was trained or recorded


def test_same_run_with_the_reference_attention_passes_the_gate(client, model_dir):
    run = client.submit(spec(model_dir, "reference"))
    done = client.wait(run["id"], timeout_s=300)
    assert done["status"] == "completed", done
    first = client.metrics(run["id"])["steps"][0]["metrics"]
    assert abs(first["iw_mean"] - 1) <= 1e-4 and first["logprob_abs_diff_max"] <= 1e-3, first


# ------------------------------------------------------------ comparing runs --
# A: fast; B: the same seed in true_on_policy numerics; C: fast with the boundary-blind attention and the
# gate loosened so far that it passes anything (the packed-boundary bug, trained on).
LOOSE_GATE = {"iw_mean_tolerance": 1e6, "iw_max": 1e30, "logprob_abs_diff_mean": 1e6}
COMPARE_STEPS = 3


def compared_spec(model_dir: Path, name: str) -> dict:
    s = spec(model_dir, "reference")
    s.update(name=name, steps=COMPARE_STEPS, eval={"every": 2, "heldout_size": 8})
    if name == "B":
        s["numerics"] = "true_on_policy"
        del s["trainer"]["attention"]  # true_on_policy runs its own batch-invariant attention
    if name == "C":
        s["trainer"]["attention"] = {"backend": BLIND}
        s["trainer"]["parity_gate"] = LOOSE_GATE
    if name in ("A", "B"):
        s["debug"] = {"record_trajectories": True}
    return s


@dataclass
class Compared:
    ids: dict[str, str]
    report: dict


@pytest.fixture(scope="module")
def compared(client, model_dir) -> Compared:
    ids = {}
    for name in ("A", "B", "C"):
        run = client.submit(compared_spec(model_dir, name))
        done = client.wait(run["id"], timeout_s=300)
        assert done["status"] == "completed", done
        ids[name] = run["id"]
    return Compared(ids, client.compare([ids["A"], ids["B"], ids["C"]]))


def cli(stack_url: str, token_file: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "--url", stack_url, "--token-file", str(token_file),
                           *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_each_run_records_its_platform_fingerprint(client, compared):
    for name, numerics in (("A", "fast"), ("B", "true_on_policy"), ("C", "fast")):
        f = client.run(compared.ids[name])["fingerprint"]
        for service in (f["trainer"], *f["rollouts"]):
            p = service["platform"]
            assert p["device"] == "cpu" and p["arch"] == platform.machine(), p
            assert p["device_name"] == (parse_cpu_model(CPUINFO_FILE.read_text()) or platform.machine())
            assert p["torch"] == torch.__version__ and p["cuda"] == (torch.version.cuda or "absent")
            assert p["transformers"] == importlib.metadata.version("transformers")
        assert f["numerics"]["mode"] == numerics and f["trainer"]["numerics"] == numerics
        assert f["world_sizes"] == {"trainer_data_parallel": 1, "rollout_replicas": 1, "rollout_engine": "torch"}
        assert f["trainer"]["logprob_backend"]  # the resolved one, whatever this host picks
    assert client.run(compared.ids["C"])["fingerprint"]["trainer"]["attention_backend"] == BLIND
    assert client.run(compared.ids["A"])["fingerprint"]["trainer"]["attention_backend"] == "reference"


def test_compare_calls_other_numerics_within_noise_and_the_boundary_bug_separable_on_iw(compared):
    report = compared.report
    print(json.dumps({m: {k: e[k] for k in ("mean", "noise_sd", "verdicts")} for m, e in report["metrics"].items()},
                     indent=1))
    a, b, c = (compared.ids[n] for n in "ABC")
    assert report["reference"] == a and [r["label"] for r in report["runs"]] == [a, b, c]
    assert report["separable"][b] == [], report["separable"]
    assert "iw_mean" in report["separable"][c], report["metrics"]["iw_mean"]
    assert "eval/heldout/avg@1" in report["metrics"]
    assert [p[0] for p in report["metrics"]["eval/heldout/avg@1"]["series"][a]] == [0, 2, 3]
    assert "noise_sd" in report["metrics"]["iw_mean"] and report["noise"]["method"]


def test_cli_table_json_and_plot_are_the_reports(stack, compared, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (requirements.lock)")
    from PIL import Image

    from services.cli.compare_plot import PANELS_KEY

    ids = [compared.ids[n] for n in "ABC"]
    done = cli(stack.api_url, stack.token_file, "compare", *ids, "--json", tmp_path / "r.json",
               "--png", tmp_path / "r.png")
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"{ids[2]} vs {ids[0]}: separable on" in done.stdout and "iw_mean" in done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report == compared.report
    with Image.open(tmp_path / "r.png") as image:
        panels = json.loads(image.text[PANELS_KEY])
    assert [p["metric"] for p in panels] == list(report["metrics"])  # one panel per metric
    for panel in panels:
        assert panel["series"] == report["metrics"][panel["metric"]]["series"]


@pytest.fixture(scope="module")
def second_coordinator(tmp_path_factory):
    """A coordinator of another deployment: its own data dir, embedded Redis and token."""
    from tests.coordinator.conftest import LoneCoordinator

    c = LoneCoordinator(tmp_path_factory.mktemp("second"), tmp_path_factory.getbasetemp()).start()
    try:
        yield c
    finally:
        c.process.stop()


@pytest.fixture(scope="module")
def bundles(stack, compared, tmp_path_factory) -> list[Path]:
    """A, B and C exported by the command line."""
    out = []
    for name in "ABC":
        path = tmp_path_factory.mktemp("bundles") / name
        done = cli(stack.api_url, stack.token_file, "export", compared.ids[name], "--out", path)
        assert done.returncode == 0, done.stderr + done.stdout
        out.append(path)
    return out


def test_exported_runs_imported_elsewhere_compare_the_same(compared, bundles, second_coordinator, tmp_path):
    assert sorted(p.name for p in (bundles[0] / "step_records").iterdir()) == [
        f"step_{s:06d}.pb" for s in range(1, COMPARE_STEPS + 1)]  # A recorded its step inputs
    assert json.loads((bundles[2] / "fingerprint.json").read_text())["trainer"]["attention_backend"] == BLIND

    # Bundles alone: no coordinator involved.
    done = cli("http://127.0.0.1:9", tmp_path / "no-token", "compare", *bundles, "--json", tmp_path / "b.json")
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads((tmp_path / "b.json").read_text()) == compared.report

    second = second_coordinator
    token_file = second.process.env[TOKEN_FILE_ENV]
    imported = []
    for bundle in bundles:
        done = cli(second.url, token_file, "import", bundle)
        assert done.returncode == 0, done.stderr + done.stdout
        imported.append(done.stdout.split(" as run ")[1].split()[0])
    http = httpx.Client(base_url=second.url, headers=second.headers, timeout=60)
    assert http.get("/v1/compare", params={"runs": ",".join(imported)}).json() == compared.report
    assert http.get(f"/v1/runs/{imported[0]}").json()["status"] == "completed"
    assert http.get("/v1/compare", params={"runs": imported[0]}).status_code == 422
    assert http.post("/v1/runs/import", json={"manifest": {}, "files": {}}).status_code == 422
    assert httpx.post(f"{second.url}/v1/runs/import", json={}).status_code == 401

    # A bundle whose trajectories were altered is refused by its digest, naming the file; nothing stored.
    before = len(http.get("/v1/runs").json()["runs"])
    altered = tmp_path / "altered"
    shutil.copytree(bundles[0], altered)
    record = altered / "step_records" / "step_000001.pb"
    data = bytearray(record.read_bytes())
    data[-5] ^= 0x01
    record.write_bytes(bytes(data))
    done = cli(second.url, token_file, "import", altered)
    assert done.returncode == 2 and "step_records/step_000001.pb" in done.stdout and "sha256" in done.stdout, done
    # The coordinator checks the documents itself, whoever sends them.
    manifest = json.loads((bundles[0] / "manifest.json").read_text())
    files = {n: (bundles[0] / n).read_text() for n in DOCUMENTS}
    files["metrics.json"] = files["metrics.json"].replace('"iw_mean"', '"iw_mean" ', 1)
    r = http.post("/v1/runs/import", json={"manifest": manifest, "files": files})
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "files.metrics.json", r.text
    assert len(http.get("/v1/runs").json()["runs"]) == before
    http.close()


def replay_score(bundle: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "replay-score", str(bundle), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["A", "B"])
def test_replay_score_reproduces_the_recorded_trainer_statistics(bundles, model_dir, name):
    """The trainer service ran one thread (LocalStack); so does the replay: same machine, same bits."""
    done = replay_score(bundles["AB".index(name)], "--step", "1", "--model", model_dir, "--num-threads", "1")
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads(done.stdout)
    print(json.dumps(report["versus_recorded_trainer"], indent=1))
    assert report["step"] == 1 and report["numerics"] == ("fast" if name == "A" else "true_on_policy")
    assert report["recorded_trainer_reproduced_bitwise"], report["versus_recorded_trainer"]
    assert set(report["versus_recorded_trainer"]) == {"iw_mean", "iw_min", "iw_max", "logprob_abs_diff_mean",
                                                      "logprob_abs_diff_max"}
    rollout = report["versus_rollout"]
    assert rollout["tokens"] > 0 and len(rollout["worst_tokens"]) == 8
    if name == "B":  # true_on_policy: the trainer's log-probs are the sampler's, token for token
        assert rollout["bitwise_equal_tokens"] == rollout["tokens"] and rollout["abs_diff_max"] == 0.0
    assert rollout["abs_diff_p99"] <= rollout["abs_diff_max"]


def test_replay_score_refuses_altered_trajectories_naming_the_file(bundles, tmp_path):
    altered = tmp_path / "altered"
    shutil.copytree(bundles[1], altered)
    record = altered / "step_records" / "step_000001.pb"
    data = bytearray(record.read_bytes())
    data[-3] ^= 0x01
    record.write_bytes(bytes(data))
    done = replay_score(altered, "--step", "1")
    assert done.returncode == 2 and "step_records/step_000001.pb" in done.stdout and "sha256" in done.stdout, done
    missing = replay_score(bundles[2], "--step", "1")  # C recorded no step
    assert missing.returncode == 2 and "no record of step 1" in missing.stdout, missing
