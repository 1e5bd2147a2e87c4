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

from dataclasses import dataclass
from typing import Literal, Protocol

import torch


class LossRule(Protocol):
    """The learning rule's knobs the loss reads (algo.*): an `AlgoConfig` has them, and so has any settings struct
    of a role that carries only these."""

    @property
    def is_cap(self) -> float: ...
    @property
    def staleness_decay(self) -> float: ...
    @property
    def clip_low(self) -> float: ...
    @property
    def clip_high(self) -> float: ...
    @property
    def aggregation(self) -> Literal["token-mean", "seq-mean-token-sum", "token-sum"]: ...
    @property
    def seq_norm(self) -> float: ...
    @property
    def token_norm(self) -> float: ...
    @property
    def kl_beta(self) -> float: ...
    @property
    def entropy_coef(self) -> float: ...
    @property
    def entropy_per(self) -> Literal["step", "credit"]: ...


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log π(tokens[:, t] | tokens[:, :t]) for t ≥ 1, shape (B, T−1); logits are (B, T, V)."""
    return token_logprobs_and_entropy(logits, tokens, temperature, entropy=False)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` and, from the same log-softmax, H(π(· | tokens[:, :t])) per position (B, T−1)."""
    return chosen_logprobs_and_entropy(logits[:, :-1], tokens[:, 1:], temperature, entropy)


def chosen_logprobs_and_entropy(
    logits: torch.Tensor, chosen: torch.Tensor, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(chosen) and, if asked, the entropy of π, from the logits that predict each chosen token: logits
    (..., V), chosen (...) token ids; the log-softmax in fp32 at `temperature`."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    return picked, (-(logp.exp() * logp).sum(-1) if entropy else None)


def importance_weights(
    logp_reference: torch.Tensor,
    behaviour_logp: torch.Tensor,
    staleness: torch.Tensor,
    algo: LossRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t = min(ρ_t, is_cap) · decay**s_t with no gradient; returns (w, ρ)."""
    rho = torch.exp(logp_reference.detach() - behaviour_logp)
    weight = torch.clamp(rho, max=algo.is_cap) * algo.staleness_decay ** staleness.float()
    return weight.detach(), rho.detach()


def tis_token_loss(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, staleness: torch.Tensor,
    algo: LossRule,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = − w_t · Â_t · log π_θ(a_t); returns (ℓ, ρ)."""
    weight, rho = importance_weights(logp, behaviour_logp, staleness, algo)
    return -weight * advantages * logp, rho


def decoupled_ppo_token_loss(
    logp: torch.Tensor, prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
    staleness: torch.Tensor, algo: LossRule,
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


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, algo: LossRule) -> torch.Tensor:
    """Token mean over all action tokens of the batch, Dr. GRPO's seq-mean-token-sum / seq_norm, or token-sum /
    token_norm: a fixed weight per token, whatever else the batch holds (docs/algorithm.md, "Loss")."""
    if algo.aggregation == "token-mean":
        return token_mean(token_loss, mask)
    mask = mask.to(token_loss.dtype)
    if algo.aggregation == "token-sum":
        return (token_loss * mask).sum() / algo.token_norm
    return (token_loss * mask).sum(dim=-1).sum() / (token_loss.shape[0] * algo.seq_norm)


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The warm start's loss: the negative log-likelihood of the demonstrated assistant tokens, token mean
    (docs/algorithm.md, "Warm start")."""
    return token_mean(-logp, mask)


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
    algo: LossRule,
    prox_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The batch loss: TIS form, or decoupled PPO when `prox_logp` is given (ppo_epochs > 1).

    With `entropy` (per token) and algo.entropy_coef > 0, − entropy_coef · H is added to the action tokens' loss
    (an exploration bonus, docs/algorithm.md "Entropy bonus"; not in the design's loss): on every action token with
    algo.entropy_per=step, times |its advantage| (A_imm or C) with algo.entropy_per=credit."""
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
            # credit: by |A_imm| or |C|, so more where the stage credit and the outcome disagree
            bonus = entropy * advantages.abs() if algo.entropy_per == "credit" else entropy
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
