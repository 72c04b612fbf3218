"""Pure tensor functions of the policy-loss variants and self-play objectives: the functional core.

Shapes: ``B`` batch (rows = samples), ``R`` response length. Masks are 0/1 and 0 on padding and
on tool/observation tokens. Every loss returns ``(scalar loss, stats)``; stats are detached
scalars (means over this call's tokens, or rows). Formulas follow verl
``verl/trainer/ppo/core_algos.py`` (``reference/verl.md`` section 2); deviations are marked
"rlflow:".

Each variant is a per-token objective, ``*_objective(...) -> (per-token loss [B, R], stats)``, with its own
parameters only: IS weights and aggregation are applied once, by ``PPOLoss`` (or by ``functional.aggregated``).
The ``*_loss`` functions are the aggregated form (verl's ``compute_policy_loss_*`` signature, which the parity
tests call): the objective's arguments, then ``agg``, ``num_tokens``, ``num_seqs``, ``weights`` and
``norm_length`` (``functional.agg_loss``'s constant for ``seq-mean-token-sum-norm``, verl
``actor.loss_scale_factor``; ``None``: ``R``).

Micro-batching: a loss must not depend on how rows are split into micro-batches, given the
mini-batch counts ``num_tokens`` / ``num_seqs`` (see ``functional.agg_loss``). Per-token and
per-sequence quantities (GSPO's sequence ratio, GMPO's geometric mean, SPPO's squared error) are
row-local, so splitting by rows keeps them exact. Quantities over the whole batch are computed
before the split and passed in: Clip-Cov / KL-Cov's token choice (``clip_cov_select`` /
``kl_cov_select``), SPPO's in-group win rate (``group_win_rate``). SPIN's loss couples the rows of
one group; ``spin_loss`` needs each group whole in a call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnF
from torch import Tensor

from rlflow.algorithms.functional import aggregated, batch_sum, masked_mean, masked_sum


def gspo_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 3e-4, clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, group sequence policy optimization (Zheng et al. 2025, arXiv 2507.18071; verl ``gspo``).

    Sequence ratio ``s_i = exp(mean_t (logp - old))`` over the valid tokens of row i (no +-20 clamp);
    token form ``log s_it = logp_t - sg(logp_t) + sg(log s_i)``, clamped at 10 (value ``s_i``, gradient
    ``s_i * grad logp_t``); loss ``max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))``.
    verl always aggregates ``seq-mean-token-mean`` (then every token gradient is ``s_i/|y_i| grad logp``,
    the paper's sequence-level gradient); rlflow: that is the default and ``agg`` may change it.
    Stats: ``pg_clipfrac`` = frac(clipped), ``ppo_kl`` = mean(old - logp), ``seq_ratio_mean`` (mean s_i).
    All inputs [B, R]; returns (per-token loss, stats).
    """
    neg_kl = log_probs - old_log_probs
    seq_log_ratio = masked_sum(neg_kl, mask, -1) / mask.sum(-1).clamp(min=1)
    # verl adds the detached sequence term last (precision, verl PR 2775)
    log_ratio = (log_probs - log_probs.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    has_tokens = (mask.sum(-1) > 0).to(ratio.dtype)
    stats = {
        "pg_clipfrac": masked_mean((loss2 > loss1).to(ratio.dtype), mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
        "seq_ratio_mean": masked_mean(seq_log_ratio.exp(), has_tokens).detach(),
    }
    return torch.maximum(loss1, loss2), stats


def gspo_loss(log_probs, old_log_probs, advantages, mask, clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean",
              num_tokens=None, num_seqs=None, weights=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`gspo_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(gspo_objective(log_probs, old_log_probs, advantages, mask, clip_low, clip_high), mask, agg,
                      num_tokens, num_seqs, weights, norm_length)


def cispo_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv 2506.13585; verl ``cispo``).

    ``r = exp(clamp(logp - old, -20, 20))``; per token ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``:
    the IS weight is clipped and detached, so no token loses its gradient (unlike PPO's clip).
    The paper sets no lower bound (``clip_low >= 1``). Stats: ``pg_clipfrac`` = frac(r outside the
    range), ``ppo_kl`` = mean(old - logp). All inputs [B, R]; returns (per-token loss, stats).
    """
    neg_kl = (log_probs - old_log_probs).clamp(-20, 20)
    ratio = torch.exp(neg_kl)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    stats = {
        "pg_clipfrac": masked_mean((ratio != clipped).to(ratio.dtype), mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
    }
    return -clipped.detach() * advantages * log_probs, stats


def cispo_loss(log_probs, old_log_probs, advantages, mask, clip_low=0.2, clip_high=0.2, agg="token-mean",
               num_tokens=None, num_seqs=None, weights=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`cispo_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(cispo_objective(log_probs, old_log_probs, advantages, mask, clip_low, clip_high), mask, agg,
                      num_tokens, num_seqs, weights, norm_length)


def sapo_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    tau_pos: float = 1.0, tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO, soft adaptive policy optimization (Gao et al. 2025, arXiv 2511.20347; verl ``sapo``).

    ``r = exp(clamp(logp - old, -20, 20))``; gate ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with
    ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``; per token ``-f(r) * A``. A smooth trust region
    in place of the hard clip: at ``r = 1`` the gradient is the plain ``-A grad logp``, and it decays
    as ``r`` leaves 1. verl always aggregates ``seq-mean-token-mean``; rlflow: the default, ``agg``
    may change it. Stats: ``ppo_kl``, ``gate_mean`` = mean ``sigmoid(tau (r - 1))`` (0.5 on-policy).
    All inputs [B, R]; returns (per-token loss, stats).
    """
    neg_kl = (log_probs - old_log_probs).clamp(-20, 20)
    ratio = torch.exp(neg_kl)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    soft = torch.sigmoid(tau * (ratio - 1))
    stats = {"ppo_kl": masked_mean(-neg_kl, mask).detach(), "gate_mean": masked_mean(soft, mask).detach()}
    return -soft * (4.0 / tau) * advantages, stats


def sapo_loss(log_probs, old_log_probs, advantages, mask, tau_pos=1.0, tau_neg=1.05, agg="seq-mean-token-mean",
              num_tokens=None, num_seqs=None, weights=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`sapo_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(sapo_objective(log_probs, old_log_probs, advantages, mask, tau_pos, tau_neg), mask, agg,
                      num_tokens, num_seqs, weights, norm_length)


def reinforce_objective(log_probs: Tensor, advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain REINFORCE (Williams 1992): per token ``-A * logp`` (verl loss mode ``gpg``, from GPG, arXiv 2504.02546).

    No ratio, no clip: off-policy samples (several mini-batches or epochs) are not corrected.
    All inputs [B, R]; returns (per-token loss, no stats).
    """
    return -advantages * log_probs, {}


def reinforce_loss(log_probs, advantages, mask, agg="token-mean", num_tokens=None, num_seqs=None, weights=None,
                   norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`reinforce_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, {})."""
    return aggregated(reinforce_objective(log_probs, advantages), mask, agg, num_tokens, num_seqs, weights, norm_length)


def gmpo_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    clip_low: float = 0.4, clip_high: float = 0.4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO, geometric-mean policy optimization (Zhao et al. 2025, arXiv 2507.20673; verl ``geo_mean``).

    Per token ``d = logp - old`` clipped in log space, pessimistically for the sign of A:
    ``d' = sgn(A) min(sgn(A) d, sgn(A) clamp(d, -clip_low, clip_high))``; the sequence ratio is the
    geometric mean ``rho_i = exp(sum_t d' m / (|y_i| + 1e-8))`` and the sequence advantage the token
    mean ``A_i = sum_t A m / (|y_i| + 1e-8)``; sequence loss ``l_i = -A_i rho_i``.
    verl takes ``mean_i l_i`` over the call's rows and ignores ``loss_agg_mode``. rlflow: ``l_i`` is
    spread over the row's tokens and aggregated with ``agg``; the default ``seq-mean-token-mean``
    is verl's mean over sequences, normalised by ``num_seqs`` so micro-batches add up (verl also
    counts rows without valid tokens). Token weights enter as their geometric mean per row (verl;
    :func:`row_geometric_mean`). Stats: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = frac(clipped and A > 0 / A < 0),
    ``ppo_kl``. All inputs [B, R]; returns (per-token loss: ``l_i`` on each of row i's tokens, stats).
    """
    neg_kl = log_probs - old_log_probs
    sign = torch.sign(advantages)
    clamped = neg_kl.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * neg_kl, sign * clamped)
    length = mask.sum(-1)
    seq_ratio = torch.exp(masked_sum(pessimistic, mask, -1) / (length + 1e-8))
    seq_adv = masked_sum(advantages, mask, -1) / (length + 1e-8)
    seq_loss = -seq_adv * seq_ratio
    clipped = (neg_kl != clamped).to(seq_ratio.dtype)
    stats = {
        "pg_clipfrac": masked_mean(clipped * (advantages > 0), mask).detach(),
        "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
    }
    return seq_loss[:, None].expand_as(log_probs), stats


def row_geometric_mean(weights: Tensor, mask: Tensor) -> Tensor:
    """``exp(sum_t m log(w + 1e-10) / (|y_i| + 1e-8))``: each row's geometric mean of its token weights, on every
    token ([B, R] -> [B, R]); how GMPO's sequence-level loss takes token IS weights (verl ``geo_mean``)."""
    geo = torch.exp(masked_sum(torch.log(weights + 1e-10), mask, -1) / (mask.sum(-1) + 1e-8))
    return geo[:, None].expand_as(weights)


def gmpo_loss(log_probs, old_log_probs, advantages, mask, clip_low=0.4, clip_high=0.4, agg="seq-mean-token-mean",
              num_tokens=None, num_seqs=None, weights=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`gmpo_objective` with the weights' :func:`row_geometric_mean`, aggregated; returns (scalar loss, stats)."""
    geo = None if weights is None else row_geometric_mean(weights, mask)
    return aggregated(gmpo_objective(log_probs, old_log_probs, advantages, mask, clip_low, clip_high), mask, agg,
                      num_tokens, num_seqs, geo, norm_length)


# ---------------------------------------------------------------- Clip-Cov / KL-Cov (Cui et al. 2025)


def token_covariance(advantages: Tensor, log_probs: Tensor, mask: Tensor, sum_fn=None) -> Tensor:
    """``(A - mean A) * (logp - mean logp)`` with means over the valid tokens; [B, R] -> [B, R] (detached).

    The centred product whose batch mean is Cov(logp, A), which drives the change of the policy's
    entropy (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617).
    With ``sum_fn`` (``functional.batch_sum``) the means are over the whole batch on every process.
    """
    advantages, log_probs = advantages.detach(), log_probs.detach()
    n = batch_sum(mask.sum().to(advantages.dtype), sum_fn) + 1e-8
    mean_a = batch_sum(masked_sum(advantages, mask), sum_fn) / n
    mean_lp = batch_sum(masked_sum(log_probs, mask), sum_fn) / n
    return (advantages - mean_a) * (log_probs - mean_lp)


def _flat_mask(valid: Tensor, chosen: Tensor) -> Tensor:
    out = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    out[chosen] = True
    return out.view(valid.shape)


def clip_cov_select(
    advantages: Tensor, log_probs: Tensor, mask: Tensor, ratio: float = 2e-4, lb: float = 1.0, ub: float = 5.0,
    exclude: Tensor | None = None, generator: torch.Generator | None = None, sum_fn=None,
) -> Tensor:
    """Clip-Cov's token choice (verl ``clip_cov``): ``k = max(int(ratio * N), 1)`` tokens, drawn uniformly
    without replacement among the valid tokens (not in ``exclude``) whose covariance lies in ``(lb, ub)``.

    ``N`` = valid tokens. The draw is ``torch.randperm`` over the candidates on the CPU with
    ``generator`` (``None``: the global CPU RNG, as verl; it is seeded by the Trainer and saved in its
    checkpoints), so a fixed seed gives a fixed choice. verl excludes tokens the PPO clip already
    cut (``exclude``). ``sum_fn``: the covariance's means over every process (:func:`token_covariance`).
    All tensors [B, R]; returns a bool [B, R] mask of the chosen tokens.
    """
    valid = mask.bool()
    cov = token_covariance(advantages, log_probs, mask, sum_fn)
    candidates = valid & (cov > lb) & (cov < ub)
    if exclude is not None:
        candidates &= ~exclude.bool()
    idx = candidates.flatten().nonzero().squeeze(1)
    k = max(int(ratio * int(valid.sum())), 1)
    perm = torch.randperm(idx.numel(), generator=generator)[:k].to(idx.device)
    return _flat_mask(valid, idx[perm])


def kl_cov_select(advantages: Tensor, log_probs: Tensor, mask: Tensor, ratio: float = 2e-4, sum_fn=None) -> Tensor:
    """KL-Cov's token choice (verl ``kl_cov``): the ``k = max(1, int(ratio * N))`` valid tokens with the
    largest covariance (``token_covariance``, with ``sum_fn``); none when there is no valid token.

    All tensors [B, R]; returns a bool [B, R] mask of the chosen tokens.
    """
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(valid)
    cov = token_covariance(advantages, log_probs, mask, sum_fn)
    idx = valid.flatten().nonzero().squeeze(1)
    top = torch.topk(cov.flatten()[idx], max(1, int(n * ratio))).indices
    return _flat_mask(valid, idx[top])


def clip_cov_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, selected: Tensor,
    clip_low: float = 0.2, clip_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov policy loss (Cui et al. 2025; verl ``clip_cov``): PPO's clipped surrogate with the
    ``selected`` (high-covariance) tokens' loss set to 0, so they give no gradient.

    ``r = exp(logp - old)`` (no +-20 clamp, as verl), ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``
    times ``1 - selected``; no dual clip. Stats: ``cov_clipfrac`` = frac(selected) (verl logs it as
    ``pg_clipfrac``), ``pg_clipfrac`` = frac(PPO-clipped), ``ppo_kl``. All inputs [B, R]; returns (per-token
    loss, stats).
    """
    neg_kl = log_probs - old_log_probs
    ratio = torch.exp(neg_kl)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    keep = (~selected.bool()).to(ratio.dtype)
    stats = {
        "cov_clipfrac": masked_mean(1 - keep, mask).detach(),
        "pg_clipfrac": masked_mean((loss2 > loss1).to(ratio.dtype), mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
    }
    return torch.maximum(loss1, loss2) * keep, stats


def clip_cov_loss(log_probs, old_log_probs, advantages, mask, selected, clip_low=0.2, clip_high=0.2,
                  agg="token-mean", num_tokens=None, num_seqs=None, weights=None,
                  norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`clip_cov_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(clip_cov_objective(log_probs, old_log_probs, advantages, mask, selected, clip_low, clip_high),
                      mask, agg, num_tokens, num_seqs, weights, norm_length)


def kl_cov_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, selected: Tensor,
    kl_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov policy loss (Cui et al. 2025; verl ``kl_cov``): the unclipped surrogate ``-A r`` plus
    ``kl_coef * |logp - old|`` on the ``selected`` (high-covariance) tokens.

    ``r = exp(logp - old)``, no clip at all (as verl). On-policy (``logp == old``) the penalty and its
    gradient are 0: it acts from the second mini-batch or epoch on. Stats: ``kl_cov_frac`` =
    frac(selected), ``ppo_kl`` = mean(old - logp), ``ppo_kl_abs`` = mean|logp - old| (verl logs this
    one as ``ppo_kl``). All inputs [B, R]; returns (per-token loss, stats).
    """
    neg_kl = log_probs - old_log_probs
    ratio = torch.exp(neg_kl)
    chosen = selected.bool().to(ratio.dtype)
    stats = {
        "kl_cov_frac": masked_mean(chosen, mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
        "ppo_kl_abs": masked_mean(neg_kl.abs(), mask).detach(),
    }
    return -advantages * ratio + kl_coef * neg_kl.abs() * chosen, stats


def kl_cov_loss(log_probs, old_log_probs, advantages, mask, selected, kl_coef=1.0, agg="token-mean",
                num_tokens=None, num_seqs=None, weights=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`kl_cov_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(kl_cov_objective(log_probs, old_log_probs, advantages, mask, selected, kl_coef), mask, agg,
                      num_tokens, num_seqs, weights, norm_length)


# ---------------------------------------------------------------- self-play: SPIN, SPPO


def sequence_log_ratio(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor) -> Tensor:
    """``log pi(y_i) / pi_ref(y_i) = sum_t m (logp - ref)``: [B, R] -> [B]."""
    return masked_sum(log_probs - ref_log_probs, mask, -1)


def spin_objective(
    log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, group: Tensor, is_reference: Tensor, beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SPIN, self-play fine-tuning (Chen et al. 2024, arXiv 2401.01335).

    Per row ``D_i = log pi(y_i) / pi_ref(y_i)`` (sequence sums). In each group (one prompt) the one
    reference row ``r`` (``is_reference``, the real response) is paired with every generated row ``j``:
    ``l_j = -log sigmoid(beta (D_r - D_j))``. The group's loss ``c_g = mean_j l_j`` is carried by each
    of its rows and aggregated with ``agg`` (default: the mean over rows, ``num_seqs``), so with
    equal groups the loss is the mean over all pairs and micro-batches of whole groups add up exactly.

    Raises ``ValueError`` if a group in this call lacks its reference row or has no generated row:
    the pair terms couple rows, so a micro-batch must hold whole groups.
    log_probs, ref_log_probs, mask: [B, R]; group, is_reference: [B]. Stats: ``spin_margin`` =
    mean ``D_r - D_j``, ``spin_accuracy`` = frac(``D_r > D_j``) over pairs. Returns (per-token loss, stats).
    """
    is_ref = is_reference.bool()
    ids, inverse = torch.unique(group, return_inverse=True)
    n_ref = torch.zeros(ids.numel(), device=group.device).index_add_(0, inverse, is_ref.float())
    n_gen = torch.zeros(ids.numel(), device=group.device).index_add_(0, inverse, (~is_ref).float())
    bad = (n_ref != 1) | (n_gen < 1)
    if bool(bad.any()):
        g = int(ids[bad.nonzero()[0, 0]])
        raise ValueError(
            f"SPIN pairs each group's reference row with its generated rows, but group {g} has "
            f"{int(n_ref[ids == g].item())} reference and {int(n_gen[ids == g].item())} generated row(s) in this "
            "micro-batch: a micro-batch must hold whole groups (split by rows, max_tokens_per_micro_batch=None, with "
            "a micro_batch_size that is a multiple of n + 1) and every group needs one reference row "
            "(rlflow.rollout.WithReferenceResponses)")
    delta = sequence_log_ratio(log_probs, ref_log_probs, mask)
    d_ref = torch.zeros(ids.numel(), dtype=delta.dtype, device=delta.device).index_add(0, inverse, delta * is_ref)
    margin = d_ref[inverse] - delta  # [B]; meaningful on generated rows
    gen = (~is_ref).to(delta.dtype)
    pair = -nnF.logsigmoid(beta * margin) * gen
    group_loss = torch.zeros_like(d_ref).index_add(0, inverse, pair) / n_gen.to(delta.dtype)
    stats = {
        "spin_margin": masked_mean(margin.detach(), gen),
        "spin_accuracy": masked_mean((margin.detach() > 0).to(delta.dtype), gen),
    }
    return group_loss[inverse][:, None].expand_as(log_probs), stats


def spin_loss(log_probs, ref_log_probs, mask, group, is_reference, beta=0.1, agg="seq-mean-token-mean",
              num_tokens=None, num_seqs=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`spin_objective` aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(spin_objective(log_probs, ref_log_probs, mask, group, is_reference, beta), mask, agg,
                      num_tokens, num_seqs, None, norm_length)


def group_win_rate(scores: Tensor, group: Tensor) -> Tensor:
    """SPPO's ``P_hat(y_i > pi | x)``: the mean over the samples ``k`` of row i's group (itself included,
    as the paper's ``1/K sum_k P(y_i > y_k)``) of ``P(y_i > y_k) = 1[s_i > s_k] + 1/2 1[s_i = s_k]``.

    A preference read off scalar scores (a Bradley-Terry model at zero temperature). An all-equal
    group gives 1/2 everywhere. scores, group: [B]; returns [B] in [0, 1]. O(B^2) memory.
    """
    same = group[:, None] == group[None, :]
    wins = (scores[:, None] > scores[None, :]).to(scores.dtype) + 0.5 * (scores[:, None] == scores[None, :])
    return (wins * same).sum(-1) / same.sum(-1)


def sppo_objective(
    log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, win_rate_centered: Tensor, eta: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SPPO, self-play preference optimization (Wu et al. 2024, arXiv 2405.00675).

    Per row ``l_i = (log pi(y_i) / pi_ref(y_i) - eta (P_hat_i - 1/2))^2`` with the sequence log-ratio
    (sums over tokens) and ``win_rate_centered = P_hat - 1/2`` ([B], from ``group_win_rate``, computed
    before the split). ``l_i`` is spread over row i's tokens and aggregated with ``agg`` (default: the
    mean over rows). Row-local, so exact under any micro-batch split.
    log_probs, ref_log_probs, mask: [B, R]. Stats: ``sppo_log_ratio`` = mean sequence log-ratio.
    Returns (per-token loss, stats).
    """
    delta = sequence_log_ratio(log_probs, ref_log_probs, mask)
    seq_loss = (delta - eta * win_rate_centered) ** 2
    has_tokens = (mask.sum(-1) > 0).to(delta.dtype)
    return seq_loss[:, None].expand_as(log_probs), {"sppo_log_ratio": masked_mean(delta.detach(), has_tokens)}


def sppo_loss(log_probs, ref_log_probs, mask, win_rate_centered, eta=1.0, agg="seq-mean-token-mean",
              num_tokens=None, num_seqs=None, norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`sppo_objective` aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(sppo_objective(log_probs, ref_log_probs, mask, win_rate_centered, eta), mask, agg,
                      num_tokens, num_seqs, None, norm_length)


def dppo_objective(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
    divergence: str = "tv", clip_low: float = 0.15, clip_high: float = 0.15, clip_c: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO, divergence-clipped policy optimization (arXiv 2602.04879; verl ``dppo_tv`` / ``dppo_kl``).

    ``r = exp(clamp(logp - old, -20, 20))``, ``p = exp(logp)``, ``q = exp(old)``. A token keeps its
    gradient unless it moved past a divergence threshold in its advantage's direction:
    ``tv``: ``A > 0`` needs ``p - q <= clip_high``, else ``p - q >= -clip_low``;
    ``kl``: with the binary KL ``q log(q/p) + (1-q) log((1-q+1e-8)/(1-p+1e-8))``, ``A > 0`` needs
    ``kl <= clip_high or p <= q``, else ``kl <= clip_low or p >= q``.
    Per token ``-A * sg(min(r, clip_c)) * logp * valid`` (truncated IS in place of the dual clip; ``clip_c``
    None: no truncation). Stats: ``pg_clipfrac`` = frac(invalid), ``pg_clipfrac_lower`` = frac(valid and
    ``r > clip_c``), ``ppo_kl`` = mean(old - logp). All inputs [B, R]; returns (per-token loss, stats).
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"DPPO divergence must be 'tv' or 'kl', got {divergence!r}")
    neg_kl = (log_probs - old_log_probs).clamp(-20, 20)
    ratio = torch.exp(neg_kl)
    cap = float("inf") if clip_c is None else clip_c
    truncated = ratio.clamp(max=cap).detach()
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    if divergence == "tv":
        up, down = (prob - old_prob) <= clip_high, (prob - old_prob) >= -clip_low
    else:
        binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        up, down = (binary_kl <= clip_high) | (prob <= old_prob), (binary_kl <= clip_low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, up, down).detach().to(log_probs.dtype)
    stats = {
        "pg_clipfrac": masked_mean(1.0 - valid, mask).detach(),
        "pg_clipfrac_lower": masked_mean((ratio > cap).to(ratio.dtype) * valid, mask).detach(),
        "ppo_kl": masked_mean(-neg_kl, mask).detach(),
    }
    return -advantages * truncated * log_probs * valid, stats


def dppo_loss(log_probs, old_log_probs, advantages, mask, divergence="tv", clip_low=0.15, clip_high=0.15,
              clip_c=3.0, agg="token-mean", num_tokens=None, num_seqs=None, weights=None,
              norm_length=None) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`dppo_objective` weighted and aggregated (``functional.aggregated``); returns (scalar loss, stats)."""
    return aggregated(dppo_objective(log_probs, old_log_probs, advantages, mask, divergence, clip_low, clip_high,
                                     clip_c), mask, agg, num_tokens, num_seqs, weights, norm_length)
