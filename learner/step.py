"""The optimizer step(s) on one batch: docs/algorithm.md's loss through `async_rl.loss`, on this rank's items."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Literal

import deepspeed
import torch
import torch.distributed as dist

from async_rl.loss import LossStats, aggregate, policy_loss, sft_loss
from async_rl.protocol import TrainItem
from learner.batch import TrainBatch, collate, collate_micro_batch
from learner.engine import rank, world_size
from learner.logits import trained_logprobs
from learner.pack import padding_fraction, plan_shards
from learner.settings import LayoutSettings, StepSettings

log = logging.getLogger("async_rl.learner")

Objective = Literal["policy", "sft"]  # the policy loss (RL), or the demonstrations' likelihood (the warm start)
SFT_STATS = LossStats(is_ratio_mean=1.0, is_ratio_max=1.0, is_capped_frac=0.0, kl=0.0)  # no ratio, no reference


def aggregate_denominator(mask: torch.Tensor, step: StepSettings) -> float:
    """What `async_rl.loss.aggregate` divides a batch's masked token-loss sum by. The aggregate is linear in the
    token loss (Σ ℓ·mask / d, d fixed by the mask: action tokens, or items × seq_norm), so d is read off by
    aggregating ones; 1.0 for an empty mask (nothing to scale)."""
    value = float(aggregate(torch.ones_like(mask, dtype=torch.float32), mask, step.loss))
    return float(mask.sum()) / value if value else 1.0


def share_scale(local: torch.Tensor, whole_denominator: float, world_size: int, step: StepSettings) -> float:
    """The factor on a part's aggregated loss (a rank's share, a micro-batch of it) that makes the parts add up to
    the whole batch's loss: the part was divided by its own denominator, the whole by the batch's, and DeepSpeed
    averages gradients over ranks, so world_size · d_part / d_whole."""
    return world_size * aggregate_denominator(local, step) / whole_denominator


def rank_micro_batches(
    items: list[TrainItem], rank: int, world_size: int, step: StepSettings
) -> list[tuple[TrainBatch, float]]:
    """This rank's micro-batches (learner/pack.py: balanced shards, packed rows, token budget) with their loss
    scales: summed over micro-batches and averaged over ranks, the scaled losses (and so the accumulated gradients)
    are the whole batch's. As many micro-batches on every rank."""
    layout = step.layout
    lengths = [item.num_tokens() for item in items]
    plan = plan_shards(lengths, world_size, layout.micro_batch_tokens, layout.packing, layout.pack_row_tokens)[rank]
    micro = [collate_micro_batch(items, m, layout.packing) for m in plan]
    if world_size == 1 and len(micro) == 1:
        return [(micro[0], 1.0)]
    whole = aggregate_denominator(collate(items).loss_mask, step)
    return [(batch, share_scale(batch.loss_mask, whole, world_size, step)) for batch in micro]


def layout_metrics(items: list[TrainItem], world_size: int, layout: LayoutSettings) -> dict[str, float | int]:
    """How the batch was laid out over every rank: the padding share of the tensors trained (fillers included) and
    the micro-batches per rank."""
    lengths = [item.num_tokens() for item in items]
    plans = plan_shards(lengths, world_size, layout.micro_batch_tokens, layout.packing, layout.pack_row_tokens)
    return {"padding_frac": padding_fraction(plans, lengths), "micro_batches": len(plans[0])}


def _whole_batch_loss(scaled_share_loss: torch.Tensor) -> float:
    """The rank average of the rescaled share losses is the whole batch's loss (see `share_scale`)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(scaled_share_loss)
        scaled_share_loss /= dist.get_world_size()
    return float(scaled_share_loss)


def _on_any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank if `flag` is True on any (ranks must agree on skipping a step: the step is collective).
    On the engine's device: NCCL reduces CUDA tensors only."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = torch.tensor([float(flag)], device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())
    return flag


def _mean_over_ranks(value: float, tokens: float, device: torch.device | str = "cpu") -> float:
    """A per-token mean of this rank's `tokens` as the whole batch's, the same on every rank (a rank that trained
    only a masked filler has no tokens and no say): the metrics line reports the batch's entropy, not rank 0's."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = torch.tensor([value * tokens, tokens], dtype=torch.float64, device=device)
        dist.all_reduce(box)
        return float(box[0] / box[1]) if box[1] > 0 else value
    return value


def _parameters(engine: deepspeed.DeepSpeedEngine) -> list[torch.nn.Parameter]:
    """The module's trained parameters (all of them, or the adapters under LoRA), listed once per engine: walking
    the module tree twice a step (the norm, the clip) cost more than the norm itself on a small model."""
    listed = getattr(engine, "_async_rl_parameters", None)
    if listed is None:
        listed = [p for p in engine.module.parameters() if p.requires_grad]
        engine._async_rl_parameters = listed
    return listed


def _gradient_norm(engine: deepspeed.DeepSpeedEngine) -> torch.Tensor | None:
    """The L2 norm of the accumulated gradient (inf or nan if any is not finite), read before the step. At ZeRO-0
    the gradients sit on the parameters after backward (this rank's: step() reduces them over ranks, and in a world
    of one that is the global norm, the one torch clips by); at ZeRO >= 1 they live in
    DeepSpeed's partitioned buffers: None, and DeepSpeed's own norm is read after the step (docs/algorithm.md,
    "Loss": only the loss is checked for finiteness there)."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad.detach() for p in _parameters(engine) if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(grads)  # foreach kernels; the clipping below reuses it


def _inputs_finite(batch: TrainBatch) -> bool:
    """The trained tokens' advantages and behaviour log-probs are finite (else no step: checked before any
    forward, so no micro-batch has accumulated a gradient yet)."""
    on = batch.loss_mask.bool()
    return bool(torch.isfinite(batch.advantages[on]).all() and torch.isfinite(batch.behaviour_logp[on]).all())


def _logp(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π of the batch's trained tokens and, if asked, the policy's entropy there (learner/logits.py: the
    output layer runs on those positions only)."""
    return trained_logprobs(model, batch, temperature, entropy=entropy)


def _combined_stats(parts: list[tuple[LossStats, float, float]]) -> LossStats:
    """One rank's statistics from its micro-batches' (stats, action tokens, loss scale): ratio, KL and entropy
    means by action token (with more ranks, this rank's share of the batch, as the ratio statistics are)."""
    tokens = sum(n for _, n, _ in parts)
    if len(parts) == 1 or tokens == 0:
        return parts[0][0]
    trained = [(s, n, scale) for s, n, scale in parts if n > 0]
    return LossStats(
        is_ratio_mean=sum(s.is_ratio_mean * n for s, n, _ in trained) / tokens,
        is_ratio_max=max(s.is_ratio_max for s, _, _ in trained),
        is_capped_frac=sum(s.is_capped_frac * n for s, n, _ in trained) / tokens,
        kl=sum(s.kl * n for s, n, _ in trained) / tokens,
        entropy=sum(s.entropy * n for s, n, _ in trained) / tokens,
    )


def train_on_items(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, items: list[TrainItem], version: int,
    step: StepSettings, objective: Objective = "policy",
) -> tuple[int, list[tuple[float, LossStats]]]:
    """This rank's share of a batch's items, in micro-batches: `train_on_micro_batches`."""
    micro = rank_micro_batches(items, rank(), world_size(), step)
    return train_on_micro_batches(engine, reference, micro, version, step, objective)


def train_on_micro_batches(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, micro: list[tuple[TrainBatch, float]],
    version: int, step: StepSettings, objective: Objective = "policy",
) -> tuple[int, list[tuple[float, LossStats]]]:
    """Run algo.ppo_epochs optimizer steps (version +1 each); returns the new version and (loss, stats) per step.

    Each step accumulates the gradients of every micro-batch's scaled loss (`rank_micro_batches`), then DeepSpeed
    reduces them across ranks and steps once (managed_gradient_accumulation off: learner/engine.py).
    One epoch uses the TIS form; more use decoupled PPO with π_prox = the policy when the batch arrived. The "sft"
    objective (the warm start, learner/sft.py) trains the demonstrated tokens' likelihood instead (`sft_loss`).
    The loss and the entropy are the whole batch's; the ratio statistics are this rank's share.

    A non-finite input, loss (checked before each backward) or gradient (after the last) refuses the step: the
    gradients are zeroed, the optimizer does not step, the weights stay exactly as they were, and the batch's
    remaining epochs are not run. Fewer results than algo.ppo_epochs say so (none: nothing of the batch was trained).
    """
    micro = [(batch.to(engine.device), scale) for batch, scale in micro]
    if _on_any_rank(not all(_inputs_finite(batch) for batch, _ in micro), engine.device):
        log.warning("non-finite advantages or behaviour log-probs at version %d: the step is skipped", version)
        return version, []
    fixed = _fixed_logprobs(engine, reference, micro, step)
    results = []
    for _ in range(step.ppo_epochs):
        result = _optimizer_step(engine, micro, fixed, version, step, objective)
        if result is None:
            break
        version += 1
        results.append(result)
    return version, results


Fixed = list[tuple[torch.Tensor | None, torch.Tensor | None]]  # per micro-batch: (reference, π_prox) log-probs


def _fixed_logprobs(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, micro: list[tuple[TrainBatch, float]],
    step: StepSettings,
) -> Fixed:
    """What stays fixed over the batch's epochs, with no gradient: each micro-batch's log-probs under the reference
    model (the KL term; None without one) and under the policy as the batch arrived (π_prox; None with one epoch)."""
    temperature = step.temperature
    fixed: Fixed = []
    with torch.no_grad():
        for batch, _ in micro:
            ref = _logp(reference, batch, temperature)[0] if reference is not None else None
            prox = _logp(engine, batch, temperature)[0] if step.ppo_epochs > 1 else None
            fixed.append((ref, prox))
    return fixed


def _optimizer_step(
    engine: deepspeed.DeepSpeedEngine, micro: list[tuple[TrainBatch, float]], fixed: Fixed, version: int,
    step: StepSettings, objective: Objective,
) -> tuple[float, LossStats] | None:
    """One optimizer step over every micro-batch: the whole batch's loss and the step's statistics, or None (the
    step was refused for a non-finite loss or gradient, on some rank, and its gradients dropped)."""
    accumulated = _accumulate_gradients(engine, micro, fixed, version, step, objective)
    norm = None if accumulated is None else _gradient_norm(engine)
    norm_value = None if norm is None else float(norm)
    if accumulated is None or not _finite_gradient(norm_value, version, engine.device):
        _drop_gradients(engine)
        return None
    _clip(engine, step, norm)
    engine.step()
    total, parts = accumulated
    return _whole_batch_loss(total), _step_stats(engine, parts, norm_value, step)


def _accumulate_gradients(
    engine: deepspeed.DeepSpeedEngine, micro: list[tuple[TrainBatch, float]], fixed: Fixed, version: int,
    step: StepSettings, objective: Objective,
) -> tuple[torch.Tensor, list[tuple[LossStats, float, float]]] | None:
    """Forward and backward of every micro-batch's scaled loss: their sum and each one's (stats, action tokens,
    scale); None where a loss is not finite on some rank (checked before its backward: nothing more runs)."""
    algo, device = step.loss, engine.device
    # The entropy is a second vocabulary-sized tensor: computed only when trained (entropy_mean is 0 otherwise).
    want_entropy = algo.entropy_coef > 0
    total = torch.zeros((), device=device)
    parts = []
    for (batch, scale), (ref_logp, prox_logp) in zip(micro, fixed, strict=True):
        if objective == "sft":
            loss, stats = sft_loss(_logp(engine, batch, 1.0)[0], batch.loss_mask), SFT_STATS
        else:
            logp, entropy = _logp(engine, batch, step.temperature, entropy=want_entropy)
            loss, stats = policy_loss(
                logp, batch.behaviour_logp, batch.advantages, batch.staleness(version), batch.loss_mask, algo,
                prox_logp=prox_logp, ref_logp=ref_logp, entropy=entropy,
            )
        scaled = loss * scale
        if _on_any_rank(not bool(torch.isfinite(scaled.detach()).all()), device):
            log.warning("non-finite loss at version %d: the step is skipped", version)
            return None
        engine.backward(scaled)
        total += scaled.detach()
        parts.append((stats, float(batch.loss_mask.sum()), scale))
    return total, parts


def _finite_gradient(norm: float | None, version: int, device: torch.device) -> bool:
    """The gradient norm read before the step (`_gradient_norm`; None: not read here) is finite on every rank."""
    if _on_any_rank(norm is not None and not math.isfinite(norm), device):
        log.warning("non-finite gradient at version %d: the step is skipped", version)
        return False
    return True


def _clip(engine: deepspeed.DeepSpeedEngine, step: StepSettings, norm: torch.Tensor | None) -> None:
    """Clip the gradient to learner.grad_clip where DeepSpeed does not (learner.engine.clips_itself): only at ZeRO-0
    in a world of one, where the norm just read is the one to clip by (not computed twice)."""
    if engine.gradient_clipping() == 0 and step.grad_clip > 0:
        assert norm is not None, "torch clips only at ZeRO-0, where _gradient_norm reads the norm"
        torch.nn.utils.clip_grads_with_norm_(_parameters(engine), step.grad_clip, norm)


def _step_stats(
    engine: deepspeed.DeepSpeedEngine, parts: list[tuple[LossStats, float, float]], norm: float | None,
    step: StepSettings,
) -> LossStats:
    """The step's statistics: this rank's micro-batches combined, the gradient norm (DeepSpeed's where it clipped
    or reduced, ZeRO >= 1; else the one read before the step) and, where computed, the whole batch's entropy."""
    reported = engine.get_global_grad_norm()
    grad_norm = float(reported) if reported is not None else (norm if norm is not None else 0.0)
    stats = replace(_combined_stats(parts), grad_norm=grad_norm)
    if step.loss.entropy_coef > 0:
        tokens = sum(n for _, n, _ in parts)
        stats = replace(stats, entropy=_mean_over_ranks(stats.entropy, tokens, engine.device))
    return stats


def _drop_gradients(engine: deepspeed.DeepSpeedEngine) -> None:
    """Forget what the refused step's micro-batches accumulated: on the parameters (ZeRO-0) and in a ZeRO
    optimizer's buffers."""
    engine.zero_grad()
    if engine.zero_optimization_stage() > 0 and hasattr(engine.optimizer, "zero_grad"):
        engine.optimizer.zero_grad()
