"""The policy's log-probs at a batch's trained tokens only: the output layer and its log-softmax run on the positions
whose next token is trained, not on every token of the batch.

The vocabulary-sized tensors (logits, log-softmax, their gradients: tokens x vocabulary x 4 bytes each, 400 MB for a
2,048-token row of a 49k vocabulary) are the largest of a learner step, and a prompt's tokens, or a packed row's
tool output and padding, need none. A forward pre-hook on the model's output layer keeps only those positions' hidden
states, so any Hugging Face causal LM (under LoRA and DeepSpeed too) computes (1, N, V) logits for the N trained
tokens; the log-probs are laid back into the batch's (B, T−1) shape with 0 elsewhere (the loss masks them out).
A model without an output layer to hook (`get_output_embeddings()` None) gets the full logits, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from async_rl.loss import chosen_logprobs_and_entropy, token_logprobs_and_entropy
from learner.batch import TrainBatch


def _output_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that turns the last hidden states into logits (lm_head), through a DeepSpeed engine and PEFT."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine holds the model as .module
    getter = getattr(inner, "get_output_embeddings", None)
    return getter() if callable(getter) else None


@contextmanager
def _positions_only(layer: torch.nn.Module, keep: torch.Tensor) -> Iterator[None]:
    """While open, `layer` sees the hidden states of the (B, T) positions in `keep` only, as one (1, N, H) row."""

    def select(_module: torch.nn.Module, args: tuple) -> tuple:
        return (args[0][keep].unsqueeze(0), *args[1:])

    handle = layer.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def trained_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π of the batch's trained tokens and, if asked, the policy's entropy there, each (B, T−1) with 0 off the
    loss mask: equal at the trained tokens (and in every gradient) to the full logits' `token_logprobs_and_entropy`."""
    layer = _output_layer(model)
    if layer is None:
        logits = model(**batch.model_inputs()).logits
        return token_logprobs_and_entropy(logits, batch.tokens, temperature, entropy=entropy)
    on = batch.loss_mask.bool()
    keep = torch.zeros_like(batch.tokens, dtype=torch.bool)
    keep[:, :-1] = on  # the logit at t-1 predicts token t
    with _positions_only(layer, keep):
        logits = model(**batch.model_inputs()).logits[0]  # (N, V)
    picked, spread = chosen_logprobs_and_entropy(logits, batch.tokens[:, 1:][on], temperature, entropy)

    def laid_out(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(on.shape).masked_scatter(on, values)

    return laid_out(picked), (laid_out(spread) if spread is not None else None)
