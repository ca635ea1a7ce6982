"""replay-score's report over scored tokens (pure): against the rollout, and against the recorded trainer;
the command line and exit status the CLI runs the entry point with."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from contract.replay_score import REPLAY_SCORE_MODULE, ReplayScoreConfig, replay_score_command
from services.cli.exchange_commands import replay_score as cli_replay_score
from services.common.process.service_config import parse_service_config
from services.trainer.loss.surrogate import mismatch_stats
from services.trainer.tools.replay_score import json_safe, score_report
from services.trainer.trainer import ScoredTokens


def scored(logp: list[float], rollout: list[float], numerics: str = "fast") -> ScoredTokens:
    n = len(logp)
    return ScoredTokens(logp=torch.tensor(logp), rollout_logp=torch.tensor(rollout),
                        sample_index=torch.tensor([i % 2 for i in range(n)]), positions=torch.arange(n) + 3,
                        sample_ids=("s0", "s1"), attention_backend="reference", logprob_backend="reference",
                        numerics=numerics)


def test_differences_against_the_rollout_and_the_recorded_statistics():
    logp = [-1.0, -2.0, -0.5, -3.0]
    rollout = [-1.0, -2.5, -0.5, -2.0]
    tokens = scored(logp, rollout)
    recorded = mismatch_stats(tokens.logp, tokens.rollout_logp).as_dict()
    report = score_report(tokens, {**recorded, "iw_max": recorded["iw_max"] + 0.25}, worst_tokens=2)
    r = report["versus_rollout"]
    assert r["tokens"] == 4 and r["bitwise_equal_tokens"] == 2
    assert r["abs_diff_mean"] == 0.375 and r["abs_diff_max"] == 1.0
    assert r["abs_diff_p99"] == float(torch.quantile(torch.tensor([0.0, 0.5, 0.0, 1.0], dtype=torch.float64), 0.99))
    assert [(w["sample_id"], w["position"]) for w in r["worst_tokens"]] == [("s1", 6), ("s1", 4)]
    assert r["worst_tokens"][0]["iw"] == math.exp(-1.0)
    v = report["versus_recorded_trainer"]
    assert v["iw_mean"]["bitwise_equal"] and v["logprob_abs_diff_max"]["difference"] == 0.0
    assert not v["iw_max"]["bitwise_equal"] and v["iw_max"]["difference"] == -0.25
    assert report["recorded_trainer_reproduced_bitwise"] is False


def test_recorded_statistics_absent_are_no_reproduction_and_nan_stays_json():
    report = score_report(scored([-1.0, -1.0], [-1.0, -1.0], "true_on_policy"), {}, worst_tokens=0)
    assert report["versus_recorded_trainer"] == {} and report["recorded_trainer_reproduced_bitwise"] is False
    assert report["versus_rollout"]["worst_tokens"] == []
    assert json_safe({"x": [float("nan"), 1.0]}) == {"x": ["nan", 1.0]}


def test_the_entry_point_reads_the_command_line_the_cli_builds(monkeypatch):
    """`lockstep replay-score` runs the trainer's entry point with every field as a flag: its parser reads
    back the same config, a value starting with '-' included, and no LOCKSTEP_REPLAY_SCORE_* variable wins."""
    config = ReplayScoreConfig(bundle="-odd dir/bundle", step=3, checkpoint="/ckpt/2", model="", device="cuda:1",
                               num_threads=0, worst_tokens=5)
    argv = replay_score_command("/py", config)
    assert argv[:3] == ["/py", "-m", REPLAY_SCORE_MODULE]
    assert importlib.util.find_spec(REPLAY_SCORE_MODULE) is not None
    monkeypatch.setenv("LOCKSTEP_REPLAY_SCORE_DEVICE", "cpu")
    assert parse_service_config(ReplayScoreConfig, env_prefix="LOCKSTEP_REPLAY_SCORE", argv=argv[3:]) == config


def test_a_refusal_of_the_entry_point_reaches_the_cli_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match=r"^replay-score: manifest.json: cannot read it"):
        cli_replay_score(ReplayScoreConfig(bundle=str(tmp_path / "absent"), step=1))
