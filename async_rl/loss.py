"""The token loss of docs/algorithm.md, "Loss", one form for immediate and correction items.

    s_t = v − v_t
    ρ_t = exp(log π_θ(a_t) − log μ_t)
    w_t = stopgrad(min(ρ_t, is_cap)) · staleness_decay ** s_t            (TIS × decay)
    ℓ_t = − w_t · Â_t · log π_θ(a_t)

With ppo_epochs > 1 the decoupled PPO form (AReaL) is used instead:
    u_t = π_θ / π_prox,   w_t = stopgrad(min(π_prox / μ, is_cap)) · decay ** s_t
    ℓ_t = − w_t · min(u_t · Â_t, clip(u_t, 1 − ε_low, 1 + ε_high) · Â_t)
With one epoch (π_prox = π_θ) both give the same gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from async_rl.config import AlgoConfig


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens[:, t] | tokens[:, :t]) for t ≥ 1, shape (B, T−1); logits are (B, T, V)."""
    return token_logprobs_and_entropy(logits, tokens, temperature, entropy=False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` and, from the same log-softmax, H(π(· | tokens[:, :t])) per position (B, T−1)."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    chosen = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return chosen, (-(logp.exp() * logp).sum(-1) if entropy else None)


def importance_weights(
    logp_reference: torch.Tensor,
    behaviour_logp: torch.Tensor,
    staleness: torch.Tensor,
    algo: AlgoConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t = min(ρ_t, is_cap) · decay**s_t with no gradient; returns (w, ρ)."""
    rho = torch.exp(logp_reference.detach() - behaviour_logp)
    weight = torch.clamp(rho, max=algo.is_cap) * algo.staleness_decay ** staleness.float()
    return weight.detach(), rho.detach()


def tis_token_loss(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, staleness: torch.Tensor,
    algo: AlgoConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = − w_t · Â_t · log π_θ(a_t); returns (ℓ, ρ)."""
    weight, rho = importance_weights(logp, behaviour_logp, staleness, algo)
    return -weight * advantages * logp, rho


def decoupled_ppo_token_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
    staleness: torch.Tensor, algo: AlgoConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = − w_t · min(u·Â, clip(u, 1−ε_low, 1+ε_high)·Â), u = π_θ/π_prox; returns (ℓ, ρ = π_prox/μ)."""
    weight, rho = importance_weights(prox_logp, behaviour_logp, staleness, algo)
    u = torch.exp(logp - prox_logp.detach())
    surrogate = torch.minimum(u * advantages, torch.clamp(u, 1 - algo.clip_low, 1 + algo.clip_high) * advantages)
    return -weight * surrogate, rho


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π_θ ‖ π_ref) per token: exp(r) − r − 1 with r = log π_ref − log π_θ."""
    r = ref_logp.detach() - logp
    return torch.exp(r) - r - 1


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over the batch's action tokens: the token-mean loss, and the per-token statistics (KL, entropy) under
    any aggregation (under token-sum or seq-mean-token-sum the aggregate grows with the batch's tokens)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, algo: AlgoConfig) -> torch.Tensor:
    """Token mean over all action tokens of the batch, Dr. GRPO's seq-mean-token-sum / seq_norm, or token-sum /
    token_norm: a fixed weight per token, whatever else the batch holds (docs/algorithm.md, "Loss")."""
    if algo.aggregation == "token-mean":
        return token_mean(token_loss, mask)
    mask = mask.to(token_loss.dtype)
    if algo.aggregation == "token-sum":
        return (token_loss * mask).sum() / algo.token_norm
    return (token_loss * mask).sum(dim=-1).sum() / (token_loss.shape[0] * algo.seq_norm)


def bonus_rows(is_correction: torch.Tensor, first_trained: torch.Tensor, algo: AlgoConfig) -> torch.Tensor | None:
    """Where the entropy bonus applies, given the correction flags and the first-trained flags (per row, or per
    token of packed rows): all (None) with entropy_per=step; otherwise each token of data once: with new-token on
    the item that carries its final credit, the correction; with first-train on the first item that trains it,
    its immediate item where one was trained, else its correction (immediate-only: every item, either way); with
    credit and credit-norm on every trained token too (None), `policy_loss` weighting each by |its advantage|."""
    if algo.entropy_per in ("step", "credit", "credit-norm") or algo.updates == "immediate-only":
        return None
    return first_trained if algo.entropy_per == "first-train" else is_correction


# credit-norm: no token's bonus weight passes this many times the batch's mean weight (one item with credit in a
# batch of uncredited ones would otherwise take the whole batch's bonus)
CREDIT_NORM_CLIP = 4.0
# (scale, clip) that leave |A| as it is: `credit`'s weights, and what every rule but credit-norm passes
UNSCALED_CREDIT = (1.0, math.inf)


def credit_bonus_weights(
    advantages: torch.Tensor, mask: torch.Tensor, is_correction: torch.Tensor, algo: AlgoConfig
) -> tuple[float, float]:
    """algo.entropy_per=credit-norm over a whole batch: (scale, clip) for the bonus weights min(|A|, clip) · scale
    of its trained tokens. Unclipped they sum to what new-token pays the batch, one per token of data (the
    correction tokens of immediate+correction; every trained token of one item kind), spread in proportion to
    |A|; clip = CREDIT_NORM_CLIP × the mean |A|, so no token gets more than CREDIT_NORM_CLIP × the batch's mean
    weight (what the clip cuts is not paid elsewhere). (0, 0) where no trained token has credit: no bonus.
    Per-token (B, T−1) tensors of the whole batch, so that every micro-batch and rank trains with the same
    weights; under any other rule UNSCALED_CREDIT."""
    if algo.entropy_per != "credit-norm":
        return UNSCALED_CREDIT
    mask = mask.double()
    paid = mask if algo.updates in ("immediate-only", "outcome-only") else mask * is_correction.double()
    credit = float((advantages.double().abs() * mask).sum())
    if credit <= 0:
        return 0.0, 0.0
    return float(paid.sum()) / credit, CREDIT_NORM_CLIP * credit / float(mask.sum())


def entropy_floor_boost(boost: float, entropy: float, algo: AlgoConfig) -> float:
    """The entropy floor's next extra bonus coefficient after an optimizer step whose trained tokens had mean
    `entropy` (docs/algorithm.md, "Entropy floor"): up by algo.entropy_floor_step while the entropy is below
    algo.entropy_floor, down by it otherwise, within [0, algo.entropy_floor_max]; 0 with the floor off. A
    non-finite entropy (the step was not measured) leaves it as it was. The coefficient trained with is
    algo.entropy_coef + boost, on the tokens algo.entropy_per names (`bonus_rows`)."""
    if algo.entropy_floor <= 0:
        return 0.0
    if not math.isfinite(entropy):
        return boost
    step = algo.entropy_floor_step if entropy < algo.entropy_floor else -algo.entropy_floor_step
    return min(max(boost + step, 0.0), algo.entropy_floor_max)


@dataclass
class LossStats:
    is_ratio_mean: float
    is_ratio_max: float
    is_capped_frac: float
    kl: float  # mean per action token (k3), whatever the aggregation
    entropy: float = 0.0  # mean entropy of the policy at the batch's action tokens (0 when not computed)
    grad_norm: float = 0.0  # global L2 norm of the step's gradient before clipping (set by the learner's step)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    staleness: torch.Tensor,
    mask: torch.Tensor,
    algo: AlgoConfig,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_rows: torch.Tensor | None = None,
    credit_weights: tuple[float, float] = UNSCALED_CREDIT,
) -> tuple[torch.Tensor, LossStats]:
    """The batch loss: TIS form, or decoupled PPO when `prox_logp` is given (ppo_epochs > 1).

    With `entropy` (per token) and algo.entropy_coef > 0, − entropy_coef · H is added to the action tokens' loss
    (an exploration bonus, docs/algorithm.md "Entropy bonus"; not in the design's loss): of every row, or with
    `entropy_rows` ((B,) per row or (B, T) per token) only where it is 1 (algo.entropy_per new-token or first-train:
    `bonus_rows`); with algo.entropy_per=credit on every token, times |its advantage|; with credit-norm times
    min(|A|, clip) · scale, `credit_weights` = (scale, clip) from the whole batch (`credit_bonus_weights`)."""
    if prox_logp is None:
        token_loss, rho = tis_token_loss(logp, behaviour_logp, advantages, staleness, algo)
    else:
        token_loss, rho = decoupled_ppo_token_loss(logp, prox_logp, behaviour_logp, advantages, staleness, algo)
    kl_value = 0.0
    if algo.kl_beta > 0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        token_loss = token_loss + algo.kl_beta * kl
        kl_value = float(token_mean(kl.detach(), mask))
    entropy_value = 0.0
    if entropy is not None:
        if algo.entropy_coef > 0:
            if algo.entropy_per in ("credit", "credit-norm"):  # by |A_imm| or |C|: more where the pieces disagree
                scale, clip = credit_weights
                bonus = entropy * advantages.abs().clamp(max=clip) * scale
            elif entropy_rows is None:
                bonus = entropy
            else:  # (B,) a flag per row, or (B, T) per token (packed rows mix item kinds)
                rows = entropy_rows.to(entropy.dtype)
                bonus = entropy * (rows.unsqueeze(-1) if rows.dim() == 1 else rows)
            token_loss = token_loss - algo.entropy_coef * bonus
        entropy_value = float(token_mean(entropy.detach(), mask))
    loss = aggregate(token_loss, mask, algo)
    on = mask.bool()
    rho_on = rho[on] if on.any() else torch.ones(1)
    stats = LossStats(
        is_ratio_mean=float(rho_on.mean()),
        is_ratio_max=float(rho_on.max()),
        is_capped_frac=float((rho_on > algo.is_cap).float().mean()),
        kl=kl_value,
        entropy=entropy_value,
    )
    return loss, stats
