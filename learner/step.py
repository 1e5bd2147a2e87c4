"""The optimizer step(s) on one batch: docs/algorithm.md's loss through `async_rl.loss`, on this rank's items."""

from __future__ import annotations

import logging

import deepspeed
import torch
import torch.distributed as dist

from async_rl.config import Config
from async_rl.loss import LossStats, bonus_rows, policy_loss, token_logprobs_and_entropy
from async_rl.protocol import TrainItem
from learner.batch import TrainBatch, collate

log = logging.getLogger("async_rl.learner")


def rank_share(items: list[TrainItem], rank: int, world_size: int, aggregation: str) -> tuple[TrainBatch, float]:
    """This rank's items, and the factor that makes the rank-averaged gradient equal the whole batch's.

    DeepSpeed averages gradients over ranks; each rank normalises by its own share, so the local loss is
    rescaled by world_size · local_normaliser / global_normaliser. A rank without items trains a masked-out copy
    of the first item: every rank must run forward and backward (collectives at ZeRO-3).
    """
    share = items[rank::world_size]
    batch = collate(share or items[:1])
    if not share:
        batch.loss_mask.zero_()
    if world_size == 1:
        return batch, 1.0
    if aggregation == "token-sum":  # a fixed normaliser: every rank's share already has the whole batch's weights
        return batch, float(world_size)
    if aggregation == "token-mean":  # normalised by action tokens
        local, total = float(batch.loss_mask.sum()), float(collate(items).loss_mask.sum())
    else:  # seq-mean-token-sum: normalised by items
        local, total = float(len(batch)), float(len(items))
    if total == 0:
        return batch, 1.0
    return batch, world_size * max(local, 1.0) / total


def _whole_batch_loss(scaled_share_loss: torch.Tensor) -> float:
    """The rank average of the rescaled share losses is the whole batch's loss (see `rank_share`)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(scaled_share_loss)
        scaled_share_loss /= dist.get_world_size()
    return float(scaled_share_loss)


def _on_any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any (ranks must agree on skipping a step: the step is collective)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = torch.tensor([float(flag)])
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())
    return flag


def _gradients_finite(engine: deepspeed.DeepSpeedEngine) -> bool:
    """Every gradient finite. Checked at ZeRO-0, where the gradients sit on the parameters after backward; at ZeRO
    >= 1 they live in DeepSpeed's partitioned buffers and only the loss is checked (docs/algorithm.md, "Loss")."""
    if engine.zero_optimization_stage() != 0:
        return True
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.stack([g.detach().abs().max() for g in grads])).all())


def _logp(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π of the batch's tokens and, if asked, the policy's entropy at every position."""
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    return token_logprobs_and_entropy(logits, batch.tokens, temperature, entropy=entropy)


def train_on_batch(
    engine: deepspeed.DeepSpeedEngine, reference: torch.nn.Module | None, batch: TrainBatch, version: int,
    config: Config, loss_scale: float = 1.0,
) -> tuple[int, list[tuple[float, LossStats]]]:
    """Run algo.ppo_epochs optimizer steps (version +1 each); returns the new version and (loss, stats) per step.

    One epoch uses the TIS form; more use decoupled PPO with π_prox = the policy when the batch arrived.
    The loss is the whole batch's; the ratio statistics are this rank's share.

    A non-finite loss (checked before backward) or gradient (after it) refuses the step: the gradients are zeroed,
    the optimizer does not step, the weights stay exactly as they were, and the batch's remaining epochs are not
    run. Fewer results than algo.ppo_epochs say so (none: nothing of the batch was trained).
    """
    algo, temperature = config.algo, config.rollout.temperature
    ref_logp = prox_logp = None
    with torch.no_grad():
        if reference is not None:
            ref_logp, _ = _logp(reference, batch, temperature)
        if algo.ppo_epochs > 1:
            prox_logp, _ = _logp(engine, batch, temperature)
    results = []
    for _ in range(algo.ppo_epochs):
        # The entropy is a second vocabulary-sized tensor: computed only when it is trained (entropy_mean is 0 then).
        logp, entropy = _logp(engine, batch, temperature, entropy=algo.entropy_coef > 0)
        loss, stats = policy_loss(
            logp, batch.behaviour_logp, batch.advantages, batch.staleness(version), batch.loss_mask, algo,
            prox_logp=prox_logp, ref_logp=ref_logp, entropy=entropy,
            entropy_rows=bonus_rows(batch.is_correction, algo),
        )
        scaled = loss * loss_scale
        if _on_any_rank(not bool(torch.isfinite(scaled.detach()).all())):
            log.warning("non-finite loss at version %d: the step is skipped", version)
            break
        engine.backward(scaled)
        if _on_any_rank(not _gradients_finite(engine)):
            log.warning("non-finite gradient at version %d: the step is skipped", version)
            engine.zero_grad()
            break
        engine.step()
        version += 1
        results.append((_whole_batch_loss(loss.detach() * loss_scale), stats))
    return version, results
