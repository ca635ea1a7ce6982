"""Prometheus config and alert rules, checked by the real promtool.

promtool comes with Debian's `prometheus` package (.ci/run installs it).
The unit tests in deploy/prometheus/tests/ feed injected series (the broken
and healthy step 1 of a Qwen3-8B run side by side); the mutation tests below prove
those unit tests would notice if a rule were loosened.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, require

PROM_DIR = REPO_ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "rules" / "lockstep_alerts.yml"
UNIT_TESTS = sorted((PROM_DIR / "tests").glob("*_test.yml"))


def promtool() -> str:
    path = shutil.which("promtool")
    require(path is not None, "promtool not found (apt-get install prometheus)")
    return path


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_check_config():
    r = run(promtool(), "check", "config", str(PROM_DIR / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    # The config pulls in the rule file (a glob that matched nothing would pass silently).
    assert "1 rule files found" in r.stdout + r.stderr


def test_check_rules():
    r = run(promtool(), "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_the_issue_asks_for_exists_and_is_unit_tested():
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    wanted = {
        "LockstepIWMeanOutOfBand", "LockstepIWMaxAboveBound", "LockstepLogprobDiffAboveGate",
        "LockstepApproxKLSpike", "LockstepM2SecondMomentHigh", "LockstepRewardNaN", "LockstepRewardFlat", "LockstepServiceDown",
        "LockstepSGLangDown", "LockstepWeightSyncSlow", "LockstepRunStalled",
        "LockstepRolloutReplicaEvicted", "LockstepRolloutNoLiveReplica", "LockstepRecomputedStepDiffers",
        "LockstepStalenessAboveBound", "LockstepMoeRoutingAgreementLow", "LockstepRewardFailureRateHigh",
    }
    assert alerts == wanted
    tested = set()
    for f in UNIT_TESTS:
        for t in yaml.safe_load(f.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                if case.get("exp_alerts"):  # at least one case where it fires
                    tested.add(case["alertname"])
    assert tested == wanted, f"alerts never shown firing in a unit test: {wanted - tested}"


def test_unit_tests_pass():
    assert UNIT_TESTS
    r = run(promtool(), "test", "rules", *map(str, UNIT_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr


# Each mutation loosens or breaks one rule; the committed unit tests must then fail.
MUTATIONS = {
    "IW band widened to 0.5": ("lockstep_step_iw_mean < 0.98", "lockstep_step_iw_mean < 0.3"),
    "NaN IW mean no longer caught": ("or lockstep_step_iw_mean != lockstep_step_iw_mean", ""),
    "IW max bound below the healthy 6.6": ("lockstep_step_iw_max > 20", "lockstep_step_iw_max > 5"),
    "stall alert ignores run status": ("and on (run_id) lockstep_run_active == 1", ""),
    "M2 bound below the healthy MI325 0.0083": ("lockstep_step_m2po_m2 > 0.1", "lockstep_step_m2po_m2 > 0.005"),
    "M2 bound above the broken run's ~17": ("lockstep_step_m2po_m2 > 0.1", "lockstep_step_m2po_m2 > 20"),
    "NaN M2 no longer caught": ("or lockstep_step_m2po_m2 != lockstep_step_m2po_m2", ""),
    "KL spike without its floor": ("lockstep_step_approx_kl_k3 > 0.001", "lockstep_step_approx_kl_k3 > 0"),
    "reward flat without completed steps": ("and on (run_id) changes(lockstep_run_step[30m]) >= 3", ""),
    "replica eviction alert ignores run status": (
        "lockstep_rollout_replicas_live) > 0\n          and on (run_id) lockstep_run_active == 1",
        "lockstep_rollout_replicas_live) > 0"),
    "replica eviction alert fires on a one-step blip": ("for: 10m", "for: 1m"),
    "recomputed-step alert fires on matched steps too": ('{outcome="differed"}[1h]', "[1h]"),
    "staleness alert only above the bound plus one": ("lockstep_step_staleness_max > lockstep_run_max_staleness",
                                                      "lockstep_step_staleness_max > lockstep_run_max_staleness + 1"),
    "reward failure rate counts cached scores as attempts": ('rate(lockstep_reward_scored_total{cached="false"}[10m])',
                                                             "rate(lockstep_reward_scored_total[10m])"),
    "reward failure rate above a half": ("          > 0.2\n        for: 5m", "          > 0.5\n        for: 5m"),
    "no-live-replica alert fires with a replica left": ("lockstep_rollout_replicas_live == 0",
                                                        "lockstep_rollout_replicas_live <= 1"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_unit_tests_catch_a_loosened_rule(name, tmp_path):
    tool = promtool()
    old, new = MUTATIONS[name]
    text = RULES.read_text()
    assert old in text, f"mutation target vanished from the rules: {old!r}"
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(text.replace(old, new))
    (tmp_path / "tests").mkdir()
    for f in UNIT_TESTS:  # same relative layout, so `../rules/...` finds the mutant
        shutil.copy(f, tmp_path / "tests" / f.name)
    mutant_rules = run(tool, "check", "rules", str(tmp_path / "rules" / RULES.name))
    assert mutant_rules.returncode == 0, f"mutation produced invalid rules: {mutant_rules.stdout}"
    r = run(tool, "test", "rules", *(str(tmp_path / "tests" / f.name) for f in UNIT_TESTS))
    assert r.returncode != 0, f"unit tests still pass with mutation {name!r}"


def test_every_runbook_link_points_at_a_readme_section():
    import re

    import yaml

    readme = (REPO_ROOT / "deploy" / "README.md").read_text()
    # GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes.
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", readme, flags=re.M)}
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    for rule in rules:
        link = rule["annotations"]["runbook"]
        path, _, anchor = link.partition("#")
        assert path == "deploy/README.md" and anchor in anchors, f"{rule['alert']}: {link} (have {sorted(anchors)})"
