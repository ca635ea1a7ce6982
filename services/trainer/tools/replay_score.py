"""`python -m services.trainer.tools.replay_score --bundle B --step S`: re-score a bundle's recorded step.

`lockstep replay-score BUNDLE --step S` runs this entry point as a process (contract/replay_score.py
holds its configuration, command line and output). The step-1 parity check, done across machines:
the step's trajectories (recorded by the run that made the bundle, checked against the bundle's
manifest) are scored by a Trainer in this process holding the weights the step started from (policy
version S - 1: the run's model for step 1, a checkpoint otherwise), with no update. The report
compares, token by token, this trainer's log-probs with the recorded rollout log-probs (mean, p99
and max of |logp - rollout_logp|, the importance-weight statistics, the worst tokens), and this
trainer's mismatch statistics with the ones the recording trainer reported for that step (its step
metrics hold them; per-token trainer log-probs are not recorded). On the machine that recorded the
step, with the same thread count, the statistics are the recorded ones: bit for bit in
true_on_policy.

parse -> build -> run -> close, as services/trainer/tools/replay.py.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from contract.replay_score import REFUSED_EXIT, ReplayScoreConfig
from contract.trainer_settings import ParityThresholds
from services.common.process.service_config import parse_service_config
from services.common.records.run_bundle import BundleError, recorded_step
from services.common.records.step_record import read_step_record
from services.trainer.parity_gate import check_parity
from services.trainer.tools.replay import recorded_request, trainer_at_step_start
from services.trainer.trainer import ScoredTokens

# The step metrics that are the same statistics over the same tokens (services/trainer/grpo.mismatch_stats).
RECORDED_STATS = ("iw_mean", "iw_min", "iw_max", "logprob_abs_diff_mean", "logprob_abs_diff_max")


def score_report(scored: ScoredTokens, recorded: dict[str, float], *, worst_tokens: int) -> dict:
    """The report over one step's scored tokens (pure): against the rollout, and against the recorded
    trainer statistics (`recorded`: the step's metrics as the recording trainer reported them)."""
    verdict = check_parity(scored.logp, scored.rollout_logp, sample_index=scored.sample_index,
                           positions=scored.positions, attention_backend=scored.attention_backend,
                           logprob_backend=scored.logprob_backend, sample_ids=list(scored.sample_ids),
                           thresholds=ParityThresholds(worst_tokens=worst_tokens), numerics=scored.numerics)
    diff = (scored.logp.double() - scored.rollout_logp.double()).abs()
    finite = diff[torch.isfinite(diff)]
    stats = verdict.stats
    versus_rollout = {
        "tokens": int(diff.numel()),
        "abs_diff_mean": float(finite.mean()) if finite.numel() else None,
        "abs_diff_p99": float(torch.quantile(finite, 0.99)) if finite.numel() else None,
        "abs_diff_max": float(finite.max()) if finite.numel() else None,
        "bitwise_equal_tokens": int((scored.logp.double() == scored.rollout_logp.double()).sum()),
        "iw": {k: stats[k] for k in ("iw_mean", "iw_min", "iw_max") if k in stats},
        "worst_tokens": [{"sample": w.sample, "sample_id": w.sample_id, "position": w.position, "logp": w.logp,
                          "rollout_logp": w.rollout_logp, "iw": w.iw} for w in verdict.worst],
    }
    versus_recorded = {}
    for key in RECORDED_STATS:
        if key in recorded and key in stats:
            here, there = float(stats[key]), float(recorded[key])
            versus_recorded[key] = {"replayed": here, "recorded": there, "difference": here - there,
                                    "bitwise_equal": here == there}
    return {
        "numerics": scored.numerics,
        "attention_backend": scored.attention_backend,
        "logprob_backend": scored.logprob_backend,
        "versus_rollout": versus_rollout,
        "versus_recorded_trainer": versus_recorded,
        "recorded_trainer_reproduced_bitwise": bool(versus_recorded) and all(
            v["bitwise_equal"] for v in versus_recorded.values()),
    }


def replay_score(config: ReplayScoreConfig) -> dict:
    # Every file against the manifest first: altered trajectories are refused before anything runs.
    _, record, recorded = recorded_step(Path(config.bundle), config.step)
    meta, chunks = read_step_record(record)
    if meta.step != config.step:
        raise BundleError(f"step_records/step_{config.step:06d}.pb", f"holds step {meta.step}")
    request = recorded_request(chunks)
    trainer = trainer_at_step_start(meta, checkpoint=config.checkpoint, device=config.device,
                                    num_threads=config.num_threads, model_path=config.model)
    report = score_report(trainer.score_tokens(request), recorded, worst_tokens=config.worst_tokens)
    return {"run_id": meta.run_id, "step": meta.step, **report}


def json_safe(value):
    """Non-finite floats (a NaN log-prob difference) as strings: the report stays JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    config = parse_service_config(ReplayScoreConfig, env_prefix="LOCKSTEP_REPLAY_SCORE", argv=argv)
    try:
        result = replay_score(config)
    except (ValueError, FileNotFoundError) as exc:  # a refused bundle, record or checkpoint
        print(f"replay-score: {exc}", file=sys.stderr)
        return REFUSED_EXIT
    print(json.dumps(json_safe(result), allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
