"""The optimizer step(s) on one batch: docs/algorithm.md's loss through `async_rl.loss`, on this rank's items."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import deepspeed
import msgspec
import torch
import torch.distributed as dist

from async_rl.config import AlgoConfig, Config
from async_rl.loss import (
    UNSCALED_CREDIT,
    LossStats,
    aggregate,
    bonus_rows,
    credit_bonus_weights,
    policy_loss,
    token_logprobs_and_entropy,
)
from async_rl.protocol import TrainItem
from learner.batch import TrainBatch, collate, collate_micro_batch
from learner.engine import rank, world_size
from learner.pack import balance_shards, padding_fraction, plan_shards

log = logging.getLogger("async_rl.learner")


def aggregate_denominator(mask: torch.Tensor, algo: AlgoConfig) -> float:
    """What `async_rl.loss.aggregate` divides a batch's masked token-loss sum by. The aggregate is linear in the
    token loss (Σ ℓ·mask / d, d fixed by the mask: action tokens, or items × seq_norm), so d is read off by
    aggregating ones; 1.0 for an empty mask (nothing to scale)."""
    value = float(aggregate(torch.ones_like(mask, dtype=torch.float32), mask, algo))
    return float(mask.sum()) / value if value else 1.0


def share_scale(local: torch.Tensor, whole_denominator: float, world_size: int, algo: AlgoConfig) -> float:
    """The factor on a part's aggregated loss (a rank's share, a micro-batch of it) that makes the parts add up to
    the whole batch's loss: the part was divided by its own denominator, the whole by the batch's, and DeepSpeed
    averages gradients over ranks, so world_size · d_part / d_whole."""
    return world_size * aggregate_denominator(local, algo) / whole_denominator


def rank_share(items: list[TrainItem], rank: int, world_size: int, algo: AlgoConfig) -> tuple[TrainBatch, float]:
    """This rank's length-balanced share of the items as one padded batch, and the factor that makes the
    rank-averaged gradient equal the whole batch's (`share_scale`). A rank without items trains a masked-out copy
    of the first item: every rank must run forward and backward (collectives at ZeRO-3)."""
    share = balance_shards([item.num_tokens() for item in items], world_size)[rank]
    batch = collate([items[i] for i in share] or items[:1])
    if not share:
        batch.loss_mask.zero_()
    if world_size == 1:
        return batch, 1.0
    return batch, share_scale(batch.loss_mask, aggregate_denominator(collate(items).loss_mask, algo), world_size, algo)


def rank_micro_batches(
    items: list[TrainItem], rank: int, world_size: int, config: Config
) -> list[tuple[TrainBatch, float]]:
    """This rank's micro-batches (learner/pack.py: balanced shards, packed rows, token budget) with their loss
    scales: summed over micro-batches and averaged over ranks, the scaled losses (and so the accumulated gradients)
    are the whole batch's. As many micro-batches on every rank."""
    learner = config.learner
    lengths = [item.num_tokens() for item in items]
    plan = plan_shards(lengths, world_size, learner.micro_batch_tokens, learner.packing, learner.pack_row_tokens)[rank]
    micro = [collate_micro_batch(items, m, learner.packing) for m in plan]
    if world_size == 1 and len(micro) == 1:
        return [(micro[0], 1.0)]
    whole = aggregate_denominator(collate(items).loss_mask, config.algo)
    return [(batch, share_scale(batch.loss_mask, whole, world_size, config.algo)) for batch in micro]


def layout_metrics(items: list[TrainItem], world_size: int, config: Config) -> dict[str, float | int]:
    """How the batch was laid out over every rank: the padding share of the tensors trained (fillers included) and
    the micro-batches per rank."""
    learner = config.learner
    lengths = [item.num_tokens() for item in items]
    plans = plan_shards(lengths, world_size, learner.micro_batch_tokens, learner.packing, learner.pack_row_tokens)
    return {"padding_frac": padding_fraction(plans, lengths), "micro_batches": len(plans[0])}


def _whole_batch_loss(scaled_share_loss: torch.Tensor) -> float:
    """The rank average of the rescaled share losses is the whole batch's loss (see `rank_share`)."""
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
    only a masked filler has no tokens and no say): the entropy floor's controller must agree across ranks."""
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
    """log π of the batch's tokens and, if asked, the policy's entropy at every position."""
    logits = model(**batch.model_inputs()).logits
    return token_logprobs_and_entropy(logits, batch.tokens, temperature, entropy=entropy)


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
    config: Config, entropy_boost: float = 0.0,
) -> tuple[int, list[tuple[float, LossStats]]]:
    """This rank's share of a batch's items, in micro-batches: `train_on_micro_batches`."""
    micro = rank_micro_batches(items, rank(), world_size(), config)
    return train_on_micro_batches(engine, reference, micro, version, config, entropy_boost, batch_credit(items, config))


def batch_credit(items: list[TrainItem], config: Config) -> tuple[float, float]:
    """The whole batch's `credit_bonus_weights` (every rank holds every item): read only under credit-norm."""
    if config.algo.entropy_per != "credit-norm":  # without building the whole batch's tensors
        return UNSCALED_CREDIT
    whole = collate(items)
    return credit_bonus_weights(whole.advantages, whole.loss_mask, whole.correction_tokens, config.algo)


def train_on_batch(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, batch: TrainBatch, version: int,
    config: Config, loss_scale: float = 1.0,
) -> tuple[int, list[tuple[float, LossStats]]]:
    """One tensor batch as a single micro-batch: `train_on_micro_batches`."""
    credit = credit_bonus_weights(batch.advantages, batch.loss_mask, batch.correction_tokens, config.algo)
    return train_on_micro_batches(engine, reference, [(batch, loss_scale)], version, config, credit_weights=credit)


def train_on_micro_batches(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, micro: list[tuple[TrainBatch, float]],
    version: int, config: Config, entropy_boost: float = 0.0, credit_weights: tuple[float, float] = UNSCALED_CREDIT,
) -> tuple[int, list[tuple[float, LossStats]]]:
    """Run algo.ppo_epochs optimizer steps (version +1 each); returns the new version and (loss, stats) per step.

    Each step accumulates the gradients of every micro-batch's scaled loss (`rank_micro_batches`), then DeepSpeed
    reduces them across ranks and steps once (managed_gradient_accumulation off: learner/engine.py).
    One epoch uses the TIS form; more use decoupled PPO with π_prox = the policy when the batch arrived.
    The loss and the entropy are the whole batch's; the ratio statistics are this rank's share.

    A non-finite input, loss (checked before each backward) or gradient (after the last) refuses the step: the
    gradients are zeroed, the optimizer does not step, the weights stay exactly as they were, and the batch's
    remaining epochs are not run. Fewer results than algo.ppo_epochs say so (none: nothing of the batch was trained).
    `entropy_boost`: the entropy floor's extra bonus coefficient (`async_rl.loss.entropy_floor_boost`);
    `credit_weights`: the whole batch's (`async_rl.loss.credit_bonus_weights`, read under entropy_per=credit-norm).
    """
    algo, temperature, device = config.algo, config.rollout.temperature, engine.device
    if entropy_boost > 0:
        algo = msgspec.structs.replace(algo, entropy_coef=algo.entropy_coef + entropy_boost)
    # The entropy is a second vocabulary-sized tensor: computed only when trained or watched (entropy_mean is 0
    # otherwise).
    want_entropy = algo.entropy_coef > 0 or algo.entropy_floor > 0
    micro = [(batch.to(device), scale) for batch, scale in micro]
    if _on_any_rank(not all(_inputs_finite(batch) for batch, _ in micro), device):
        log.warning("non-finite advantages or behaviour log-probs at version %d: the step is skipped", version)
        return version, []
    ref_logp: list[torch.Tensor | None] = [None] * len(micro)
    prox_logp: list[torch.Tensor | None] = [None] * len(micro)
    with torch.no_grad():
        for m, (batch, _) in enumerate(micro):
            if reference is not None:
                ref_logp[m], _ = _logp(reference, batch, temperature)
            if algo.ppo_epochs > 1:
                prox_logp[m], _ = _logp(engine, batch, temperature)
    results = []
    for _ in range(algo.ppo_epochs):
        total = torch.zeros((), device=device)
        parts = []
        refused = False
        for m, (batch, scale) in enumerate(micro):
            logp, entropy = _logp(engine, batch, temperature, entropy=want_entropy)
            loss, stats = policy_loss(
                logp, batch.behaviour_logp, batch.advantages, batch.staleness(version), batch.loss_mask, algo,
                prox_logp=prox_logp[m], ref_logp=ref_logp[m], entropy=entropy,
                entropy_rows=bonus_rows(batch.correction_tokens, batch.first_tokens, algo),
                credit_weights=credit_weights,
            )
            scaled = loss * scale
            if _on_any_rank(not bool(torch.isfinite(scaled.detach()).all()), device):
                log.warning("non-finite loss at version %d: the step is skipped", version)
                refused = True
                break
            engine.backward(scaled)
            total += scaled.detach()
            parts.append((stats, float(batch.loss_mask.sum()), scale))
        norm_tensor = None if refused else _gradient_norm(engine)
        norm = None if norm_tensor is None else float(norm_tensor)
        if not refused and _on_any_rank(norm is not None and not math.isfinite(norm), device):
            log.warning("non-finite gradient at version %d: the step is skipped", version)
            refused = True
        if refused:
            _drop_gradients(engine)
            break
        if engine.gradient_clipping() == 0 and config.learner.grad_clip > 0:  # learner.engine.clips_itself
            # Only at ZeRO-0 in a world of one, where the norm just read is the one to clip by: not computed twice.
            assert norm_tensor is not None, "torch clips only at ZeRO-0, where _gradient_norm reads the norm"
            torch.nn.utils.clip_grads_with_norm_(_parameters(engine), config.learner.grad_clip, norm_tensor)
        engine.step()
        version += 1
        reported = engine.get_global_grad_norm()  # DeepSpeed's, where it clipped or reduced (ZeRO >= 1)
        norm = float(reported) if reported is not None else (norm if norm is not None else 0.0)
        stats = replace(_combined_stats(parts), grad_norm=norm)
        if want_entropy:  # the whole batch's, not this rank's share: the entropy floor steers by it
            stats = replace(stats, entropy=_mean_over_ranks(stats.entropy, sum(n for _, n, _ in parts), device))
        results.append((_whole_batch_loss(total), stats))
    return version, results


def _drop_gradients(engine: deepspeed.DeepSpeedEngine) -> None:
    """Forget what the refused step's micro-batches accumulated: on the parameters (ZeRO-0) and in a ZeRO
    optimizer's buffers."""
    engine.zero_grad()
    if engine.zero_optimization_stage() > 0 and hasattr(engine.optimizer, "zero_grad"):
        engine.optimizer.zero_grad()
