"""The policy-gradient objective of a step (PPO-clip, GSPO, M2PO) and how token losses aggregate.

Pure functions over flat per-token tensors of response tokens (the layout of
services/trainer/loss/surrogate.py). The run-spec settings that choose them
(`trainer.policy_loss`, `trainer.loss_agg`) are in contract/trainer_settings.py.

What "old" means. Every objective takes a ratio against the PPO old policy,
which the trainer chooses from `trainer.mismatch_correction`:
- mode 'none': the rollout's log-probs (the behaviour policy). The ratio then
  measures the train/inference mismatch plus nothing else, since the rollout
  sampled from the weights the trainer holds (one update per step).
- mode 'truncate' / 'mask': the trainer's own pre-update log-probs (decoupled
  PPO: the proximal policy). The ratio is exactly 1 in value; its gradient is
  the policy gradient, and the token losses are weighted by the correction
  weight w = pi_train / pi_rollout.

How each objective composes with that:
- ppo_clip: token ratio, clipped to [1 - clip_eps_low, 1 + clip_eps_high]. Both
  modes.
- gspo: the sequence ratio exp(mean over the sequence of (logp - old_logp)),
  clipped to [1 - gspo_clip_low, 1 + gspo_clip_high], one value and one clip
  decision per sequence. Only with mode 'none':
  against the proximal policy the sequence ratio is identically 1, so the
  clip (the point of GSPO) could never act; the config refuses it.
- m2po: tokens masked by the second moment of Δ = logp_pre - rollout_logp
  (the trainer's pre-update log-probs against the behaviour policy, whatever
  the mode: that is the staleness M2PO constrains); the kept tokens use the
  unclipped ratio against the old policy. Both modes: with 'mask' it is the
  decoupled form AReaL's M2PO recipe runs (rejection of tokens whose w leaves
  the mask band, on top of the M2 mask).

Every log-ratio is clamped before exp (policy_loss.log_ratio_bound for token
ratios and the KL term, gspo_log_ratio_bound for GSPO's sequence ratio), so a
step of stale or broken rollouts yields a finite loss and gradient; a clamped
ratio is a constant. docs/losses.md gives each formula as the tests' float64
oracle (tests/trainer/loss/test_loss_oracle.py) writes it.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from contract.trainer_run import TrainerRunConfig
from contract.trainer_settings import LossAggregation, PolicyLoss
from services.trainer.loss.mismatch_correction import correction_weights
from services.trainer.loss.surrogate import bounded_exp, clipped_surrogate, kl_to_reference


@dataclass(frozen=True)
class TokenLoss:
    loss: torch.Tensor     # float32 [N], differentiable in logp: each token's loss before aggregation
    clipped: torch.Tensor  # bool [N]: the clip branch was taken (no gradient from this token)
    clamped: torch.Tensor  # bool [N]: the token's (or its sequence's) log-ratio was beyond its bound and clamped


def ppo_clip_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                        clip_low: float, clip_high: float, log_ratio_bound: float) -> TokenLoss:
    """Token-level PPO-clip loss (to minimise), with the masks of clipped and clamped tokens:

    ratio = exp(clamp(logp - old_logp, -log_ratio_bound, log_ratio_bound))
    loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    Inside the bound the ratio keeps the bits of exp(logp - old_logp) and its gradient."""
    ratio, clamped = bounded_exp(logp - old_logp, log_ratio_bound)
    return TokenLoss(*clipped_surrogate(ratio, advantages, clip_low=clip_low, clip_high=clip_high), clamped)


def sequence_mean(values: torch.Tensor, sample_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's mean of `values` in float64, [G]; each token's sequence in that order, [N]).

    Summed in float64 from the float64 values; no grad. `sample_index[i]` names token i's sequence; tokens
    of a sequence need not be adjacent."""
    seqs, inverse = torch.unique(sample_index, return_inverse=True)
    d = values.detach().double()
    sums = torch.zeros(len(seqs), dtype=torch.float64, device=d.device).index_add_(0, inverse, d)
    counts = torch.zeros(len(seqs), dtype=torch.float64, device=d.device).index_add_(0, inverse, torch.ones_like(d))
    return sums / counts, inverse


@dataclass(frozen=True)
class SequenceRatio:
    ratio: torch.Tensor    # float32 [N]: the token's sequence ratio, one value per sequence bit for bit; grad per token
    exact: torch.Tensor    # float64 [N], no grad: the same ratio before its rounding to float32
    clamped: torch.Tensor  # bool [N]: the sequence's log-ratio was beyond the bound (ratio constant, no gradient)


def gspo_sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, sample_index: torch.Tensor, *,
                        log_ratio_bound: float) -> SequenceRatio:
    """GSPO-token's ratio: value s = exp(clamp(mean over the sequence of (logp - old_logp))), gradient per token.

    s_t = sg[s] * pi(y_t) / sg[pi(y_t)] (the paper's stop-gradient form): every token of a sequence carries
    the sequence ratio s, and d s_t = s * d logp_t, so summing the token losses of a sequence with weight
    1/|y| gives exactly GSPO's sequence-level gradient s * A * mean_t(d logp_t).

    The log-ratio and s are computed once per sequence in float64 (from the float64 of the float32 inputs)
    and s is rounded to float32 once, then given to each token as s * (1 + (logp - sg[logp])): x - x is
    exactly 0, so every token holds s's bits. Forming it as exp(seq + logp - sg[logp]) instead rounds the
    sequence log-ratio at the spacing of each token's own log-prob, and a sequence near a clip bound then
    ends up partly clipped."""
    log_ratio, inverse = sequence_mean(logp.detach().double() - old_logp.detach().double(), sample_index)
    clamped = log_ratio.abs() > log_ratio_bound
    exact = torch.exp(torch.clamp(log_ratio, -log_ratio_bound, log_ratio_bound))
    value = exact.to(logp.dtype)[inverse]
    live = (logp - logp.detach()) * (~clamped)[inverse]  # 0 in value; carries d logp where not clamped
    return SequenceRatio(value + value * live, exact[inverse], clamped[inverse])


def gspo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    sample_index: torch.Tensor, *, clip_low: float, clip_high: float,
                    log_ratio_bound: float) -> TokenLoss:
    """GSPO: -min(s A, clip(s, 1 - low, 1 + high) A) on the sequence ratio s.

    The clip branch is chosen from s in float64 against the float64 bounds, so the decision is the one the
    formula makes, not the float32 rounding of s: a sequence 3e-7 below 1 + high is not clipped. Every token
    of a sequence has the same s (and GRPO the same advantage), so clipping acts on whole sequences."""
    seq = gspo_sequence_ratio(logp, old_logp, sample_index, log_ratio_bound=log_ratio_bound)
    a = advantages.detach()
    clipped = ((a > 0) & (seq.exact > 1.0 + clip_high)) | ((a < 0) & (seq.exact < 1.0 - clip_low))
    bounded = torch.clamp(seq.ratio.detach(), 1.0 - clip_low, 1.0 + clip_high)
    loss = -(torch.where(clipped, bounded, seq.ratio) * advantages)
    return TokenLoss(loss, clipped, seq.clamped)


def m2po_keep_mask(delta: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's second-moment mask: True for the tokens kept in the loss.

    Tokens are taken in descending order of Δ^2 and masked one by one until the mean Δ^2 of the ones
    left is <= threshold. Masking the largest value never raises the mean of the rest, so this masks the
    fewest tokens that meet the bound. If even the single smallest Δ^2 exceeds the threshold, that one
    token is kept (nothing else is), as AReaL does, so a step always has a loss.

    Choices matched to AReaL (areal/trainer/ppo/actor.py, `_apply_m2po_masking` and
    `_get_m2po_loss_mask`): Δ is the behaviour (rollout) log-prob against the proximal (trainer,
    pre-update) log-prob, squared without the 1/2; masking proceeds from the largest Δ^2; at least one
    token survives. Where this differs, on purpose: the stopping test is `<= threshold` (AReaL tests `<`;
    the two differ only when a mean equals the threshold exactly); the sort is stable, so tied Δ^2 are
    masked in token order and the mask is reproducible; suffix means run in float64; the caller applies
    it over the whole step's tokens (every microbatch, every rank), where AReaL applies it per
    loss-function call, so here the microbatch split does not change the mask; and the loss keeps
    trainer.loss_agg's divisor, all the step's tokens for token_mean (the paper's 1 / sum_i |o_i|),
    where AReaL divides each microbatch's kept-token sum by its kept count.
    """
    if delta.dim() != 1:
        raise ValueError(f"m2po_keep_mask: want a 1-d tensor, got shape {tuple(delta.shape)}")
    if not threshold > 0:
        raise ValueError(f"m2po_keep_mask: threshold must be > 0, got {threshold}")
    n = delta.numel()
    if n == 0:
        raise ValueError("m2po_keep_mask: no tokens")
    m2 = delta.detach().double().square()
    order = torch.sort(m2, descending=True, stable=True).indices
    ranked = m2[order]
    # suffix_mean[k] = mean of ranked[k:], the tokens left after masking the k largest.
    suffix_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64, device=m2.device)
    below = torch.nonzero(suffix_mean <= threshold)
    num_masked = int(below[0]) if len(below) else n - 1
    keep = torch.ones(n, dtype=torch.bool, device=delta.device)
    keep[order[:num_masked]] = False
    return keep


def m2po_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    keep: torch.Tensor, *, log_ratio_bound: float) -> TokenLoss:
    """M2PO: -r A on the kept tokens, 0 on the masked ones; r = exp(clamp(logp - old_logp)), never clipped.

    The masked tokens' ratios are bounded too: torch.where passes them a zero gradient, and zero times an
    overflowed exp's derivative would be NaN. `clamped` counts them, masked or kept."""
    ratio, clamped = bounded_exp(logp - old_logp, log_ratio_bound)
    loss = torch.where(keep, -(ratio * advantages), torch.zeros_like(ratio))
    return TokenLoss(loss, torch.zeros_like(keep), clamped)


def policy_token_loss(config: PolicyLoss, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                      sample_index: torch.Tensor, clip_eps_low: float, clip_eps_high: float,
                      m2po_keep: torch.Tensor | None) -> TokenLoss:
    """Per-token loss of `config.kind`; `m2po_keep` (m2po only) is this microbatch's slice of the step's mask."""
    if config.kind == "ppo_clip":
        return ppo_clip_token_loss(logp, old_logp, advantages, clip_low=clip_eps_low, clip_high=clip_eps_high,
                                   log_ratio_bound=config.log_ratio_bound)
    if config.kind == "gspo":
        return gspo_token_loss(logp, old_logp, advantages, sample_index, clip_low=config.gspo_clip_low,
                               clip_high=config.gspo_clip_high, log_ratio_bound=config.gspo_log_ratio_bound)
    if m2po_keep is None or m2po_keep.shape != logp.shape:
        raise ValueError("policy_token_loss: kind 'm2po' needs the step's keep mask for these tokens")
    return m2po_token_loss(logp, old_logp, advantages, m2po_keep, log_ratio_bound=config.log_ratio_bound)


# ------------------------------------------------------------ aggregation --


@dataclass(frozen=True)
class StepShape:
    """What aggregation and the M2PO mask need to know of the whole step, fixed before the first microbatch.

    Sequences are numbered in canonical order (batching.canonical_order), as `response_sample_index` is."""

    sequence_lengths: torch.Tensor  # int64 [G]: loss tokens (the model's response tokens) of each sequence

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum())

    def token_keys(self, sample_index: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """Each loss token's index in the step's canonical token order (sequence by sequence, in sequence
        order): the same whatever microbatch, rank or layout the token was trained in. `ranks` index each
        token among its own sequence's loss tokens (Microbatch.response_ranks)."""
        offsets = torch.cumsum(self.sequence_lengths, 0) - self.sequence_lengths
        return offsets[sample_index.cpu()] + ranks.cpu()


def step_shape(ordered_samples: list) -> StepShape:
    """StepShape of samples already in canonical order (batching.TrainSample): environment tokens of a
    multi-turn episode count in no length, since they are in no loss."""
    return StepShape(sequence_lengths=torch.tensor([s.num_model_tokens for s in ordered_samples], dtype=torch.int64))


def aggregate_loss(token_loss: torch.Tensor, sample_index: torch.Tensor, step: StepShape, *,
                   loss_agg: LossAggregation, loss_agg_tokens: int | None) -> torch.Tensor:
    """One microbatch's share of the step loss; the shares of every microbatch sum to the step loss.

    With G sequences, L_i response tokens in sequence i, N = sum L_i, l_it the token losses:
    - token_mean:              sum_it l_it / N
    - seq_mean_token_mean:     (1/G) sum_i (1/L_i) sum_t l_it
    - seq_mean_token_sum_norm: (1/G) sum_i (1/C) sum_t l_it, C = loss_agg_tokens (Dr. GRPO's constant:
                               the generation budget, so no sequence is reweighted by its length)
    Each share divides by step-wide constants (N, G, L_i, C), never by the microbatch's own counts, so
    the microbatch split does not change the update. `sample_index` indexes step.sequence_lengths.
    """
    if loss_agg == "token_mean":
        return token_loss.sum() / step.num_tokens
    num_sequences = len(step.sequence_lengths)
    if loss_agg == "seq_mean_token_sum_norm":
        if loss_agg_tokens is None:
            raise ValueError("aggregate_loss: seq_mean_token_sum_norm needs loss_agg_tokens")
        return token_loss.sum() / (loss_agg_tokens * num_sequences)
    lengths = step.sequence_lengths.to(token_loss.device)[sample_index].to(token_loss.dtype)
    return (token_loss / lengths).sum() / num_sequences


# ------------------------------------------------------------ one microbatch --


@dataclass(frozen=True)
class MicrobatchLoss:
    loss: torch.Tensor         # scalar, differentiable: this microbatch's share of the step loss
    token_loss: torch.Tensor   # float32 [N], no grad: each token's loss before aggregation (weights, KL included)
    clipped: torch.Tensor      # bool [N]: tokens whose ratio was clipped
    clamped: torch.Tensor      # bool [N]: tokens with a log-ratio (policy ratio, IS weight, KL) beyond its bound
    is_weight: torch.Tensor    # float32 [N]: mismatch-correction weights (1 with mode 'none')
    is_affected: torch.Tensor  # bool [N]: weights truncated or masked
    kl: torch.Tensor | None    # float32 [N] k3 KL to the reference, None without one


def microbatch_loss(config: TrainerRunConfig, logp: torch.Tensor, rollout_logp: torch.Tensor,
                    advantages: torch.Tensor, sample_index: torch.Tensor, step: StepShape, *,
                    m2po_keep: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None) -> MicrobatchLoss:
    """The loss of one microbatch's response tokens, from the trainer's log-probs `logp` (differentiable).

    mismatch_correction 'none': the rollout is the PPO old policy. Otherwise the trainer's own
    pre-update log-probs are, and w = pi_train / pi_rollout (truncated or masked) weights each token.
    The KL term to the reference (ref_logp given) is added per token before aggregation."""
    correction = config.mismatch_correction
    bound = config.policy_loss.log_ratio_bound
    weights = correction_weights(logp.detach() - rollout_logp, sample_index, correction, log_ratio_bound=bound)
    old_logp = rollout_logp if correction.mode == "none" else logp.detach()
    token = policy_token_loss(config.policy_loss, logp, old_logp, advantages, sample_index=sample_index,
                              clip_eps_low=config.clip_eps_low, clip_eps_high=config.clip_eps_high,
                              m2po_keep=m2po_keep)
    token_loss, clamped = token.loss, token.clamped | weights.clamped
    if correction.mode != "none":
        token_loss = token_loss * weights.weights
    kl = None
    if ref_logp is not None:
        kl = kl_to_reference(logp, ref_logp, log_ratio_bound=bound)
        clamped = clamped | ((ref_logp - logp).detach().abs() > bound)
        token_loss = token_loss + config.kl_coef * kl
    loss = aggregate_loss(token_loss, sample_index, step, loss_agg=config.loss_agg,
                          loss_agg_tokens=config.loss_agg_tokens)
    return MicrobatchLoss(loss, token_loss.detach(), token.clipped, clamped, weights.weights, weights.affected,
                          None if kl is None else kl.detach())
