"""Every policy loss against a float64 oracle written from its paper's formula.

The oracle (`oracle` below) is plain numpy float64, token by token and sequence by sequence, with no code
shared with services/trainer: PPO-clip (Schulman et al. 2017), GSPO's sequence ratio and its GSPO-token
gradient (Zheng et al. 2025), M2PO's second-moment mask (Zheng et al. 2025), truncated and masked importance
weights at token, sequence and geometric level (TIS: Yao et al. 2025; MIS as verl's rollout correction), the
k3 KL term, and the three aggregations (token mean, sequence mean of token means, Dr. GRPO's constant
normaliser), with the log-ratio bounds of docs/losses.md. The implementation runs in float32 as the trainer
runs it: `microbatch_loss` over a random split of the step into microbatches, tokens shuffled inside each,
gradients accumulated into the step's log-probs.

The bound is derived from float32 rounding (u = 2^-24, the unit roundoff), not measured:
- a token's log-ratio d = logp - old is one float32 subtraction: error <= u |d|, which exp turns into a
  relative error u |d| of the ratio (`cond`: the sequence's sum of |d| for sequence-level weights, its mean
  of |d| for geometric ones, 0 for GSPO, whose ratio is formed in float64 and rounded to float32 once);
- exp itself: at most 2 ulp (CUDA's expf; CPU torch is within 1 ulp), 4u relative;
- then at most 8 more float32 roundings on one token's path (clip bound, x A, x w, + KL, / L, / G, the
  weight's rounding to float32, the gradient's own product): K = 12 covers exp and these;
- the step loss adds the float32 sum over a microbatch of n terms, (n - 1) u sum |terms| in any order.
So a token's loss may be off by u (cond + K) |magnitude|, its gradient likewise, and the step loss by the
aggregated token errors plus (n + K) u sum of |weighted token losses|.

Where the formula is discontinuous (a clip edge, a mask edge, a clamp edge) and the oracle's value lies
within that rounding error of the edge, either side is right: there the implementation must lie between
the two branches (at an exact tie torch.minimum splits the gradient in half, a subgradient of the kink).
GSPO decides its clip in float64, so its band is float64's: its clip decisions must equal the oracle's.

The data follow the issue's setup: 8-64 sequences of 1-300 tokens, deltas of log-uniform magnitude in
[1e-7, 30] (or [1e-7, 1e-3]) with random signs, plus tokens and sequences placed as close to each clip,
mask and clamp edge as float32 inputs allow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from contract.trainer_run import TrainerRunConfig
from services.trainer.loss.distillation import distillation_advantages
from services.trainer.loss.policy_loss import StepShape, m2po_keep_mask, microbatch_loss

U = 2.0 ** -24  # float32 unit roundoff
K = 12          # float32 roundings on one token's path, exp's 2 ulp counted as 4 (see the module docstring)
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4
BOUND, GSPO_BOUND = 20.0, 10.0
IS_UPPER, IS_LOWER = 2.0, 0.5
M2PO_TAU = 0.04
KL_COEF = 0.05
SUM_NORM_TOKENS = 300


# ------------------------------------------------------------ the oracle --


@dataclass
class Step:
    logp: np.ndarray     # float64 [N]: float32 values
    rollout: np.ndarray  # float64 [N]
    ref: np.ndarray | None
    adv: np.ndarray      # float64 [N], one value per sequence
    seq: np.ndarray      # int64 [N], canonical order (sequence by sequence)
    lengths: np.ndarray  # int64 [G]
    # On-policy distillation (draw_distillation_step): `adv` is then the exact float64 mixed advantage, and
    # the implementation computes its own from these.
    teacher: np.ndarray | None = None   # float64 [N]: the teacher's float32 log-probs
    task_adv: np.ndarray | None = None  # float64 [N]: the task's float32 GRPO advantage, one per sequence
    adv_err: np.ndarray | None = None   # float64 [N]: bound on |float32 advantage - adv| (one rounding + float64 sums)


@dataclass
class Oracle:
    loss: float                # the step loss
    grad: np.ndarray           # d loss / d logp per token
    grad_alt: np.ndarray       # at a kink (`kink`), the gradient of the other side; elsewhere = grad
    kink: np.ndarray           # bool: within rounding of a clip or clamp edge, where the loss is continuous
    tol_grad: np.ndarray       # per-token gradient bound
    tol_loss: float            # step-loss bound
    clipped: np.ndarray        # bool
    clamped: np.ndarray        # bool
    clamp_band: np.ndarray     # bool: within rounding of a log-ratio bound
    gspo_band: np.ndarray      # bool: a GSPO sequence within float64 rounding of a clip edge
    keep: np.ndarray | None    # M2PO's mask
    keep_band: np.ndarray      # bool: M2PO tokens whose side of the cut rounding may change
    affected: np.ndarray       # bool: importance weight truncated or masked
    affected_band: np.ndarray  # bool: importance weight within rounding of an edge
    near_edge: int             # tokens within 1e-5 (in log-ratio) of a clip, mask or clamp edge


def seq_sums(values: np.ndarray, seq: np.ndarray, g: int) -> np.ndarray:
    out = np.zeros(g)
    for i in range(g):
        out[i] = math.fsum(values[seq == i])
    return out


def m2po_mask(delta: np.ndarray, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """M2PO: mask the largest delta^2 one by one until the mean of the rest is <= tau; keep at least one.

    The rest after masking is always some number k of the smallest squares, whose mean grows with k: so
    the kept set is the largest k whose mean is <= tau (sums from the smallest up, all terms positive).
    Also returns the tokens the float32 implementation may put on either side: those whose square is
    within rounding of the squares either side of the cut."""
    sq = delta * delta
    order = np.argsort(sq, kind="stable")
    ranked = sq[order]
    means = np.cumsum(ranked) / np.arange(1, len(sq) + 1)
    kept = max(int(np.sum(means <= tau)), 1)
    keep = np.zeros(len(sq), dtype=bool)
    keep[order[:kept]] = True

    def close(a, b):
        return np.abs(a - b) <= 1e-5 * np.maximum(np.abs(a), np.abs(b))

    # How many are kept is decided by the mean against tau; the fixed seeds below never put it within
    # rounding of tau (say so if that ever changes).
    assert not close(means[kept - 1], tau) and not (kept < len(sq) and close(means[kept], tau)), \
        "test data put M2PO's mean within float32 rounding of tau at the cut; pick another seed"
    band = np.zeros(len(sq), dtype=bool)
    if kept < len(sq) and close(ranked[kept - 1], ranked[kept]):
        band = close(sq, ranked[kept - 1]) | close(sq, ranked[kept])
    return keep, band


def oracle(step: Step, cfg: dict, *, keep: np.ndarray | None = None, affected: np.ndarray | None = None) -> Oracle:
    """The step's loss and gradient in float64 from the formulas.

    `keep` and `affected`, where given, replace the oracle's own M2PO mask and importance-weight decisions:
    the comparison passes the implementation's once they are checked to differ only within rounding of an
    edge, so that the values are then compared on the same side of each jump."""
    kind = cfg.get("policy_loss", {}).get("kind", "ppo_clip")
    corr = cfg.get("mismatch_correction", {"mode": "none"})
    mode, level = corr["mode"], corr.get("level", "token")
    agg = cfg.get("loss_agg", "seq_mean_token_mean" if kind == "gspo" else "token_mean")
    n, g = len(step.logp), len(step.lengths)
    adv = step.adv
    delta = step.logp - step.rollout  # exact: both are float32 values
    # The PPO old policy: the rollout (mode none) or the trainer's own pre-update policy (ratio exactly 1).
    d_ratio = delta if mode == "none" else np.zeros(n)
    none = np.zeros(n, dtype=bool)
    kink, gspo_band, keep_band = none.copy(), none.copy(), none.copy()
    keep_own, clipped = None, none.copy()

    if kind == "gspo":
        # s_i = exp(mean_t(logp - old)), clamped; -min(s A, clip(s) A); GSPO-token gradient -A s, 0 when clipped.
        means = seq_sums(d_ratio, step.seq, g) / step.lengths
        mc = np.clip(means, -GSPO_BOUND, GSPO_BOUND)
        s = np.exp(mc)[step.seq]
        clamped = (np.abs(means) > GSPO_BOUND)[step.seq]
        clipped = ((adv > 0) & (s > 1 + GSPO_HIGH)) | ((adv < 0) & (s < 1 - GSPO_LOW))
        pol_loss = -np.where(clipped, np.clip(s, 1 - GSPO_LOW, 1 + GSPO_HIGH), s) * adv
        pol_grad = np.where(clipped | clamped, 0.0, -adv * s)
        pol_grad_alt = pol_grad
        r_mag = np.maximum(s, np.clip(s, 1 - GSPO_LOW, 1 + GSPO_HIGH))
        pol_mag = r_mag * np.abs(adv)
        cond = np.zeros(n)  # the ratio is formed in float64 and rounded to float32 once
        # float64 band: the implementation sums in another order, an error of at most L ulp of the largest
        # |delta| on the mean, and its exp may differ from numpy's by an ulp.
        slack = step.lengths * 2.0 ** -52 * seq_max_abs(d_ratio, step.seq, g) + 2.0 ** -50
        gspo_band = ((np.abs(mc - math.log1p(GSPO_HIGH)) <= slack)
                     | (np.abs(mc - math.log1p(-GSPO_LOW)) <= slack))[step.seq]
        clamp_band = (np.abs(np.abs(means) - GSPO_BOUND) <= slack)[step.seq]
        near = near_any(means, (math.log1p(GSPO_HIGH), math.log1p(-GSPO_LOW), GSPO_BOUND, -GSPO_BOUND))[step.seq]
    else:
        # r = exp(clamp(logp - old, +-BOUND)).
        r = np.exp(np.clip(d_ratio, -BOUND, BOUND))
        clamped = np.abs(d_ratio) > BOUND
        clamp_band = np.abs(np.abs(d_ratio) - BOUND) <= 2 * U * np.abs(d_ratio)
        cond = np.abs(d_ratio)
        near = near_any(d_ratio, (math.log1p(CLIP_HIGH), math.log1p(-CLIP_LOW), BOUND, -BOUND))
        if kind == "ppo_clip":
            # -min(r A, clip(r, 1 - low, 1 + high) A); no gradient where the clipped branch is the smaller.
            unclipped, bounded = r * adv, np.clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv
            pol_loss = -np.minimum(unclipped, bounded)
            clipped = bounded < unclipped
            pol_grad = np.where(clipped | clamped, 0.0, -adv * r)
            r_band = r * (cond + K) * U
            kink = (np.abs(r - (1 + CLIP_HIGH)) <= r_band) | (np.abs(r - (1 - CLIP_LOW)) <= r_band)
            r_mag = np.maximum(r, np.clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH))
            pol_mag = r_mag * np.abs(adv)
        else:
            # M2PO: -r A on the kept tokens, the mask from logp - rollout (whatever the PPO old policy is).
            keep_own, keep_band = m2po_mask(delta, M2PO_TAU)
            kept = keep_own if keep is None else keep
            pol_loss = np.where(kept, -r * adv, 0.0)
            pol_grad = np.where(kept & ~clamped, -adv * r, 0.0)
            r_mag = r
            pol_mag = r * np.abs(adv)
        # At a kink or a clamp edge either side's gradient is right: 0, or the unclipped -A r.
        kink = kink | clamp_band
        pol_grad_alt = np.where(kink, np.where(pol_grad == 0, -adv * r, 0.0), pol_grad)
        if kind == "m2po":
            pol_grad_alt = np.where(kept, pol_grad_alt, 0.0)

    # Importance weights of the decoupled modes (the ratio above is then exactly 1): w = pi_train / pi_rollout
    # per token, per sequence (product) or per sequence's geometric mean; truncated at `upper` or masked
    # outside [lower, upper].
    w = np.ones(n)
    affected_own, affected_band = none.copy(), none.copy()
    if mode != "none":
        if level == "token":
            log_w, w_cond = delta, np.abs(delta)
        else:
            sums, abs_sums = seq_sums(delta, step.seq, g), seq_sums(np.abs(delta), step.seq, g)
            if level == "geometric":
                sums, abs_sums = sums / step.lengths, abs_sums / step.lengths
            log_w, w_cond = sums[step.seq], abs_sums[step.seq]
        # log w is clamped to +-BOUND before exp, like every other log-ratio.
        raw = np.exp(np.clip(log_w, -BOUND, BOUND))
        clamped = clamped | (np.abs(log_w) > BOUND)
        clamp_band = clamp_band | (np.abs(np.abs(log_w) - BOUND) <= (w_cond + K) * U)
        lower = corr.get("lower", 1 / IS_UPPER) if mode == "mask" else None
        edges = (math.log(IS_UPPER),) + ((math.log(lower),) if lower else ())
        near = near | near_any(log_w, edges + (BOUND, -BOUND))
        affected_band = np.any([np.abs(log_w - e) <= (w_cond + K) * U for e in edges], axis=0)
        if mode == "truncate":
            affected_own = raw > IS_UPPER
            w = np.minimum(raw, IS_UPPER)  # continuous: no decision to take from the implementation
        else:
            affected_own = (raw < lower) | (raw > IS_UPPER)
            w = np.where(affected_own if affected is None else affected, 0.0, raw)
        cond = cond + w_cond

    # The KL term (not importance-weighted): beta * k3 of the clamped log(ref / policy).
    kl_loss = kl_grad = kl_grad_alt = kl_tol_loss = kl_tol_grad = np.zeros(n)
    kl_clamped = none
    if step.ref is not None:
        d = step.ref - step.logp
        dc = np.clip(d, -BOUND, BOUND)
        kl_clamped = np.abs(d) > BOUND
        kl_loss = KL_COEF * (np.exp(dc) - dc - 1)
        kl_grad = np.where(kl_clamped, 0.0, -KL_COEF * (np.exp(dc) - 1))
        kl_edge = np.abs(np.abs(d) - BOUND) <= 2 * U * np.abs(d)
        kl_grad_alt = np.where(kl_edge, np.where(kl_clamped, -KL_COEF * (np.exp(dc) - 1), 0.0), kl_grad)
        clamp_band, kink = clamp_band | kl_edge, kink | kl_edge
        # k3 cancels for small d: its error is absolute, u times the sizes of e^d, d and 1 it is formed from.
        kl_tol_loss = KL_COEF * U * (np.abs(dc) + K) * (np.exp(dc) + np.abs(dc) + 1)
        kl_tol_grad = KL_COEF * U * (np.abs(dc) + K) * (np.exp(dc) + 1)

    tok_loss = w * pol_loss + kl_loss
    tok_grad = w * pol_grad + kl_grad
    tok_grad_alt = w * pol_grad_alt + kl_grad_alt
    tol_tok = U * (cond + K) * w * pol_mag
    if step.adv_err is not None:  # a computed (distillation) advantage: its own error, times the ratio
        tol_tok = tol_tok + w * r_mag * step.adv_err
    if agg == "token_mean":
        a = np.full(n, 1.0 / n)
    elif agg == "seq_mean_token_mean":
        a = 1.0 / (g * step.lengths[step.seq])
    else:
        a = np.full(n, 1.0 / (SUM_NORM_TOKENS * g))
    # A microbatch holds at most the whole step: its float32 sum of n terms adds (n - 1) u sum |terms|.
    tol_loss = math.fsum(a * (tol_tok + kl_tol_loss)) + (n + K) * U * math.fsum(a * np.abs(tok_loss))
    return Oracle(loss=math.fsum(a * tok_loss), grad=a * tok_grad, grad_alt=a * tok_grad_alt, kink=kink,
                  tol_grad=a * (tol_tok + kl_tol_grad) * (1 + 4 * U) + 1e-44, tol_loss=tol_loss, clipped=clipped,
                  clamped=clamped | kl_clamped, clamp_band=clamp_band, gspo_band=gspo_band, keep=keep_own,
                  keep_band=keep_band, affected=affected_own, affected_band=affected_band, near_edge=int(near.sum()))


def near_any(x: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    return np.any([np.abs(x - e) <= 1e-5 for e in edges], axis=0)


def seq_max_abs(values: np.ndarray, seq: np.ndarray, g: int) -> np.ndarray:
    out = np.zeros(g)
    np.maximum.at(out, seq, np.abs(values))
    return out


# ------------------------------------------------------------ the data --


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def draw_step(rng: np.random.Generator, cfg: dict, *, max_delta: float) -> Step:
    """8-64 sequences of 1-300 tokens; deltas of log-uniform magnitude in [1e-7, max_delta], random signs;
    a sixteenth of the tokens (an eighth of the sequences) then placed at the edges the config has."""
    g = int(rng.integers(8, 65))
    lengths = rng.integers(1, 301, g)
    n = int(lengths.sum())
    seq = np.repeat(np.arange(g), lengths)
    rollout = -np.exp(rng.uniform(math.log(1e-4), math.log(30.0), n))
    delta = rng.choice([-1.0, 1.0], n) * np.exp(rng.uniform(math.log(1e-7), math.log(max_delta), n))
    logp = rollout + delta
    logp = np.where(logp > 0, rollout - np.abs(delta), logp)  # stay a log-prob: flip the sign
    logp, rollout = f32(logp), f32(rollout)

    kind = cfg.get("policy_loss", {}).get("kind", "ppo_clip")
    corr = cfg.get("mismatch_correction", {"mode": "none"})

    def pair(i: int, target: float) -> None:
        """Token i's (logp, rollout) with logp - rollout as close to `target` as float32 allows."""
        x = min(0.0, target) - math.exp(rng.uniform(math.log(1e-3), math.log(30.0)))
        lo, ro = f32(x), f32(x - target)
        nonlocal logp, rollout
        logp[i], rollout[i] = lo, ro

    edges = []
    if corr["mode"] != "none":
        upper = corr.get("upper", IS_UPPER)
        edges = [math.log(upper), BOUND, -BOUND] + (
            [math.log(corr.get("lower", 1 / upper))] if corr["mode"] == "mask" else [])
    elif kind == "ppo_clip":
        edges = [math.log1p(CLIP_HIGH), math.log1p(-CLIP_LOW), BOUND, -BOUND]
    elif kind == "m2po":
        edges = [BOUND, -BOUND]
    elif kind == "gspo":
        edges = [math.log1p(GSPO_HIGH), math.log1p(-GSPO_LOW), GSPO_BOUND, -GSPO_BOUND]
    sequence_level = kind == "gspo" or (corr["mode"] != "none" and corr.get("level", "token") != "token")
    if edges and sequence_level:
        for i in rng.choice(g, size=max(1, g // 8), replace=False):
            target = edges[int(rng.integers(len(edges)))]
            total = target if corr.get("level") == "sequence" else target * lengths[i]
            idx = np.flatnonzero(seq == i)
            # Small deltas on all but the last token, then the last one closes the sum as closely as float32
            # allows (trying the neighbouring float32 values of its log-prob).
            for j in idx[:-1]:
                pair(j, float(rng.choice([-1.0, 1.0]) * rng.uniform(0, 1e-3)))
            rest = math.fsum(logp[idx[:-1]] - rollout[idx[:-1]])
            last = idx[-1]
            pair(last, total - rest)
            near = np.nextafter(np.float32(logp[last]), np.float32([-np.inf, np.inf])).astype(np.float64)
            logp[last] = min((c for c in (logp[last], *near) if c <= 0),
                             key=lambda c: abs(rest + (c - rollout[last]) - total))
    elif edges:
        idx = rng.choice(n, size=max(1, n // 16), replace=False)
        target = np.asarray(edges)[rng.integers(len(edges), size=len(idx))]
        x = np.minimum(0.0, target) - np.exp(rng.uniform(math.log(1e-3), math.log(30.0), len(idx)))
        logp[idx], rollout[idx] = f32(x), f32(x - target)

    adv_seq = rng.normal(size=g)
    adv_seq[rng.random(g) < 0.1] = 0.0
    ref = None
    if cfg.get("kl_coef", 0.0) > 0:
        d_ref = rng.choice([-1.0, 1.0], n) * np.exp(rng.uniform(math.log(1e-7), math.log(30.0), n))
        ref = f32(np.minimum(logp + d_ref, 0.0))
    return Step(logp=logp, rollout=rollout, ref=ref, adv=f32(adv_seq)[seq], seq=seq, lengths=lengths)


# ------------------------------------------------------------ the float32 implementation --


@dataclass
class Result:
    loss: float
    grad: np.ndarray
    clipped: np.ndarray
    clamped: np.ndarray
    affected: np.ndarray
    keep: np.ndarray | None


def implementation(step: Step, cfg: dict, rng: np.random.Generator) -> Result:
    """microbatch_loss over a random split of the step's sequences, tokens shuffled within each microbatch."""
    config = TrainerRunConfig.model_validate(cfg)
    g, n = len(step.lengths), len(step.logp)
    shape = StepShape(sequence_lengths=torch.tensor(step.lengths))
    logp = torch.tensor(step.logp, dtype=torch.float32, requires_grad=True)
    rollout = torch.tensor(step.rollout, dtype=torch.float32)
    adv = torch.tensor(step.adv, dtype=torch.float32)
    if step.teacher is not None:
        teacher = torch.tensor(step.teacher, dtype=torch.float32)
        task_adv = torch.tensor(step.task_adv, dtype=torch.float32)
        starts = np.concatenate([[0], np.cumsum(step.lengths)[:-1]])
        ranks = torch.tensor(np.arange(n) - starts[step.seq])
        settings = config.teacher
    ref = None if step.ref is None else torch.tensor(step.ref, dtype=torch.float32)
    seq = torch.tensor(step.seq)
    keep = None
    if config.policy_loss.kind == "m2po":  # over the whole step, as the trainer computes it (float32 deltas)
        keep = m2po_keep_mask((logp.detach() - rollout), config.policy_loss.m2po_threshold)
    order = rng.permutation(g)
    cuts = np.sort(rng.choice(np.arange(1, g), size=int(rng.integers(0, min(8, g))), replace=False))
    total = 0.0
    clipped, clamped, affected = (np.zeros(n, dtype=bool) for _ in range(3))
    for part in np.split(order, cuts):
        idx = np.concatenate([np.flatnonzero(step.seq == i) for i in part])
        idx = torch.tensor(rng.permutation(idx))
        mb_adv = adv[idx]
        if step.teacher is not None:  # from the microbatch's own shuffled tokens, as the trainer computes it
            mb_adv = distillation_advantages(settings, teacher[idx], rollout[idx], task_adv[idx], seq[idx],
                                             ranks[idx])
        out = microbatch_loss(config, logp[idx], rollout[idx], mb_adv, seq[idx], shape,
                              m2po_keep=None if keep is None else keep[idx],
                              ref_logp=None if ref is None else ref[idx])
        out.loss.backward()
        total += float(out.loss.detach())  # in microbatch order, as the trainer sums them
        clipped[idx.numpy()] = out.clipped.numpy()
        clamped[idx.numpy()] = out.clamped.numpy()
        affected[idx.numpy()] = out.is_affected.numpy()
    return Result(total, logp.grad.double().numpy(), clipped, clamped, affected,
                  None if keep is None else keep.numpy())


# ------------------------------------------------------------ the comparison --


CONFIGS = {
    "ppo_clip": {"clip_eps_high": CLIP_HIGH},
    "gspo": {"policy_loss": {"kind": "gspo"}},
    "m2po": {"policy_loss": {"kind": "m2po"}},
    "ppo_kl": {"clip_eps_high": CLIP_HIGH, "kl_coef": KL_COEF},
    "gspo_kl": {"policy_loss": {"kind": "gspo"}, "kl_coef": KL_COEF},
    **{f"{mode}_{level}": {"clip_eps_high": CLIP_HIGH,
                           "mismatch_correction": {"mode": mode, "level": level, "upper": IS_UPPER}}
       for mode in ("truncate", "mask") for level in ("token", "sequence", "geometric")},
    "m2po_mask": {"policy_loss": {"kind": "m2po"}, "mismatch_correction": {"mode": "mask", "upper": IS_UPPER}},
}
AGGS = {"token_mean": {"loss_agg": "token_mean"}, "seq_mean_token_mean": {"loss_agg": "seq_mean_token_mean"},
        "seq_mean_token_sum_norm": {"loss_agg": "seq_mean_token_sum_norm", "loss_agg_tokens": SUM_NORM_TOKENS}}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tensors of a few thousand elements: a thread pool only adds contention on a shared host.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check(step: Step, cfg: dict, rng: np.random.Generator) -> Oracle:
    got = implementation(step, cfg, rng)
    own = oracle(step, cfg)
    # Decisions: the same as the oracle's, except within rounding of their edge. GSPO's clip is decided in
    # float64 on both sides, so its band is float64's.
    if own.keep is not None:
        np.testing.assert_array_equal(got.keep[~own.keep_band], own.keep[~own.keep_band], err_msg="M2PO mask")
    np.testing.assert_array_equal(got.affected[~own.affected_band], own.affected[~own.affected_band],
                                  err_msg="importance-weight truncation or mask")
    sure = ~own.kink & ~own.gspo_band
    np.testing.assert_array_equal(got.clipped[sure], own.clipped[sure], err_msg="clip decisions")
    np.testing.assert_array_equal(got.clamped[~own.clamp_band], own.clamped[~own.clamp_band],
                                  err_msg="clamp decisions")
    # Values on the implementation's side of each jump (M2PO's mask, MIS's mask).
    want = oracle(step, cfg, keep=got.keep, affected=got.affected)
    # Gradients: within the bound of the oracle's; at a kink of the loss, between its two sides.
    lo = np.minimum(want.grad, want.grad_alt) - want.tol_grad
    hi = np.maximum(want.grad, want.grad_alt) + want.tol_grad
    bad = np.flatnonzero((got.grad < lo) | (got.grad > hi))
    assert not len(bad), (f"{len(bad)} gradients off, e.g. token {bad[0]}: {got.grad[bad[0]]!r} not in "
                          f"[{lo[bad[0]]!r}, {hi[bad[0]]!r}] (oracle {want.grad[bad[0]]!r})")
    assert abs(got.loss - want.loss) <= want.tol_loss, (got.loss, want.loss, want.tol_loss)
    return own


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", CONFIGS)
def test_float32_losses_match_the_float64_oracle(name, agg):
    cfg = CONFIGS[name] | AGGS[agg]
    seen_edge = seen_clip = 0
    for seed in range(3):
        for max_delta in (1e-3, 30.0):
            rng = np.random.default_rng([sum(map(ord, name)), sum(map(ord, agg)), seed, int(max_delta > 1)])
            step = draw_step(rng, cfg, max_delta=max_delta)
            want = check(step, cfg, rng)
            seen_edge += want.near_edge
            seen_clip += int(want.clipped.sum())
    # The cases exercise what they claim: tokens at the edges, and clips for the losses that clip.
    assert seen_edge > 0
    if cfg.get("policy_loss", {}).get("kind") != "m2po" and "mismatch_correction" not in cfg:
        assert seen_clip > 0


# ------------------------------------------------------------ on-policy distillation --


def draw_distillation_step(rng: np.random.Generator, cfg: dict, *, max_delta: float) -> Step:
    """draw_step's step plus a teacher: its log-probs differ from the rollout's (the student's) by log-uniform
    magnitudes in [1e-7, 8]; `adv` is the exact float64 mixed advantage of cfg's teacher settings."""
    step = draw_step(rng, cfg, max_delta=max_delta)
    teacher_cfg = cfg["teacher"]
    gamma, kw, rw = teacher_cfg.get("discount", 0.0), teacher_cfg.get("kl_weight", 1.0), \
        teacher_cfg.get("reward_weight", 0.0)
    n = len(step.logp)
    d = rng.choice([-1.0, 1.0], n) * np.exp(rng.uniform(math.log(1e-7), math.log(8.0), n))
    teacher = f32(np.minimum(step.rollout + d, 0.0))
    r = teacher - step.rollout  # exact: both float32 values
    returns, abs_returns = np.zeros(n), np.zeros(n)
    for i in range(len(step.lengths)):
        idx = np.flatnonzero(step.seq == i)
        k = np.arange(len(idx))
        # gamma^(k - t) for k >= t, 0 before: row t sums sequence i's log-ratios from token t on.
        powers = np.where(k[None, :] >= k[:, None], float(gamma) ** np.maximum(k[None, :] - k[:, None], 0), 0.0)
        if gamma == 0:
            powers = np.eye(len(idx))
        returns[idx] = [math.fsum(row) for row in powers * r[idx][None, :]]
        abs_returns[idx] = (powers * np.abs(r[idx])[None, :]).sum(axis=1)
    exact = kw * returns + rw * step.adv
    # The implementation sums in float64 (at most L terms per token, then the weighted sum: L + 4 roundings of
    # 2^-53 of the terms' magnitudes) and rounds to float32 once (u of its value).
    length = step.lengths[step.seq]
    err = U * np.abs(exact) * (1 + 2.0 ** -50) + (length + 4) * 2.0 ** -52 * (kw * abs_returns + rw * np.abs(step.adv))
    return Step(logp=step.logp, rollout=step.rollout, ref=step.ref, adv=exact, seq=step.seq, lengths=step.lengths,
                teacher=teacher, task_adv=step.adv, adv_err=err)


TEACHER = {"model_path": "the-loss-never-reads-it"}
DISTILL_CONFIGS = {
    "reverse_kl": {"clip_eps_high": CLIP_HIGH, "teacher": TEACHER},
    "reverse_kl_discounted": {"clip_eps_high": CLIP_HIGH, "teacher": TEACHER | {"discount": 0.9}},
    "mixed_with_reward": {"clip_eps_high": CLIP_HIGH,
                          "teacher": TEACHER | {"kl_weight": 0.7, "reward_weight": 0.5, "discount": 0.5}},
    "mixed_kl_truncate": {"clip_eps_high": CLIP_HIGH, "kl_coef": KL_COEF,
                          "mismatch_correction": {"mode": "truncate", "level": "token", "upper": IS_UPPER},
                          "teacher": TEACHER | {"kl_weight": 1.0, "reward_weight": 1.0}},
    "gspo_mixed": {"policy_loss": {"kind": "gspo"}, "teacher": TEACHER | {"reward_weight": 0.3, "discount": 1.0}},
}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("name", DISTILL_CONFIGS)
def test_distillation_loss_matches_the_float64_oracle(name, agg):
    """The per-token reverse-KL advantage, alone or mixed with the task's, computed from each microbatch's
    shuffled tokens, gives the oracle's loss and gradient within the bound (plus the advantage's own error)."""
    cfg = DISTILL_CONFIGS[name] | AGGS[agg]
    seen_clip = 0
    for seed in range(2):
        for max_delta in (1e-3, 30.0):
            rng = np.random.default_rng([sum(map(ord, name)), sum(map(ord, agg)), seed, int(max_delta > 1), 7])
            step = draw_distillation_step(rng, cfg, max_delta=max_delta)
            assert np.abs(step.adv - step.task_adv).max() > 1e-3  # the teacher's term is in the advantage
            want = check(step, cfg, rng)
            seen_clip += int(want.clipped.sum())
    if "mismatch_correction" not in cfg:
        assert seen_clip > 0


def test_the_oracle_refuses_a_distillation_advantage_off_by_more_than_its_bound():
    """The check above can fail: the same step with the teacher's log-probs nudged by 1e-3 on one token."""
    cfg = DISTILL_CONFIGS["reverse_kl"] | AGGS["token_mean"]
    rng = np.random.default_rng(11)
    step = draw_distillation_step(rng, cfg, max_delta=1e-3)
    nudged = step.teacher.copy()
    i = int(np.argmax(np.abs(step.adv) < 5))
    nudged[i] = f32(nudged[i] - 1e-3)
    bad = Step(**{**step.__dict__, "teacher": nudged})
    with pytest.raises(AssertionError, match="gradients off|loss"):
        check(bad, cfg, rng)
