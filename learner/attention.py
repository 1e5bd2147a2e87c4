"""Which attention kernel the learner's model runs packed rows through (`learner.attention`), chosen for the device.

A packed row lays several sequences end to end with position ids restarting at 0 (learner/batch.py). Every choice
keeps attention within each sequence; they differ in what the kernel is given:

  dense   transformers' `sdpa`: from the position ids it builds a block-diagonal causal mask, one dense
          row x row boolean matrix per micro-batch, and sdpa computes every block of it (cost: a row's length
          squared, the masked-out blocks included).
  varlen  torch's fused sdpa kernel (flash on CPU and GPU) run with is_causal on each sequence alone, sequences of
          about one length batched in one call; cost: about the sum of the sequences' lengths squared, no mask.
          Registered with transformers as the attention implementation `sdpa_varlen`: the packed-sequence
          boundaries come from the position ids (as transformers' flash-attention path takes them), a padding
          mask's edges from the 2-D attention mask (a right-padded row: its sequence, then its padding).
  flash   transformers' `flash_attention_2`: flash-attention's own varlen kernel (cu_seqlens from the position
          ids); needs a GPU and the flash_attn package.
  flex    transformers' `flex_attention`: a compiled FlexAttention kernel with a BlockMask (document mask from
          the position ids) that skips the masked-out blocks; GPU only, since torch has no FlexAttention backward
          on CPU ("FlexAttention does not support backward on CPU").

auto: flash on a GPU with flash_attn installed; else varlen for packed rows longer than 64 tokens, and dense for
shorter rows (the default learner.pack_row_tokens, 64) and unpacked ones, where the mask is cheap. Measured in
benchmarks/attention.py (docs/results.md, "Packed attention").
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from async_rl.errors import ConfigError
from learner.settings import LayoutSettings

VARLEN = "sdpa_varlen"  # the name under which transformers knows the varlen choice
IMPLEMENTATIONS = {"dense": "sdpa", "varlen": VARLEN, "flash": "flash_attention_2", "flex": "flex_attention"}
# auto keeps the dense mask for packed rows this short and for unpacked layouts: there a row's mask costs less than
# varlen's gathering (benchmarks/attention.py, the default tiny model: varlen 0.86x dense at 64-token rows of short
# sequences, about even at 128, 3-4x at 4,096; docs/results.md, "Packed attention")
SHORT_ROW_TOKENS = 64
WINDOWED_BELOW = 256  # sequences shorter than this share windows of similar length (bucket)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def select_attention(setting: str, device: str, flash_installed: bool, row_tokens: int | None = None) -> str:
    """learner.attention resolved to transformers' attn_implementation name on `device` ("cpu" or "cuda") for packed
    rows of `row_tokens` (None: unpacked, one padded item per row). The caller passes flash_attn_installed(); tests
    pass the answer of a machine they are not on."""
    if setting == "auto":
        if device == "cuda" and flash_installed:
            return IMPLEMENTATIONS["flash"]
        return IMPLEMENTATIONS["varlen" if row_tokens is not None and row_tokens > SHORT_ROW_TOKENS else "dense"]
    if setting not in IMPLEMENTATIONS:
        raise ConfigError(f"learner.attention: expected auto, {', '.join(IMPLEMENTATIONS)}; got {setting!r}")
    if setting in ("flash", "flex") and device != "cuda":
        raise ConfigError(f"learner.attention: {setting} needs a GPU; this learner runs on {device} "
                          "(set auto, varlen or dense)")
    if setting == "flash" and not flash_installed:
        raise ConfigError("learner.attention: flash needs the flash_attn package, which is not installed "
                          "(pip install flash-attn, or set auto, varlen or flex)")
    return IMPLEMENTATIONS[setting]


def row_tokens(layout: LayoutSettings) -> int | None:
    """The packed row length the learner plans (learner/pack.py), None when it does not pack."""
    return (layout.pack_row_tokens or layout.micro_batch_tokens) if layout.packing else None


def use_attention(model: torch.nn.Module, implementation: str) -> None:
    """Make `model` (a transformers model) attend through `implementation`, a value of IMPLEMENTATIONS."""
    if implementation == VARLEN:
        AttentionInterface.register(VARLEN, sdpa_varlen_forward)
        AttentionMaskInterface.register(VARLEN, flash_attention_mask)  # None, or the 2-D mask when there is padding
    model.set_attn_implementation(implementation)


def sequence_bounds(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: int,
                    length: int) -> list[int]:
    """Start offsets of the sequences in the flattened (rows x length) layout, and its end: a sequence starts at
    every row's first slot, wherever the position id is 0 (packed rows; a row's padding tail restarts at 0 too) and
    wherever a padding mask turns on or off."""
    starts = position_ids.expand(rows, length) == 0
    starts[:, 0] = True
    if attention_mask is not None:
        mask = attention_mask[:, -length:].bool()
        starts[:, 1:] |= mask[:, 1:] != mask[:, :-1]
    return [*starts.reshape(-1).nonzero().view(-1).tolist(), rows * length]


def bucket(length: int) -> int:
    """The window a sequence of `length` tokens is computed in: a short one's (under WINDOWED_BELOW tokens) is the
    next power of sqrt(2), at most 2x its attention, so that a row of many short sequences takes a dozen sdpa calls;
    a longer one is computed at its own length (its call's overhead is small beside its work)."""
    if length >= WINDOWED_BELOW:
        return length
    return int(math.ceil(2 ** (math.ceil(2 * math.log2(max(length, 1))) / 2)))


def sdpa_varlen_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        position_ids: torch.Tensor | None = None, **_: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (query B x H x T x D, key and value B x H_kv x T x D; returns
    B x T x H x D): causal attention within each sequence, torch's sdpa on the sequences of one window at once.

    A sequence is computed in a window of bucket(length) slots from its first token on: the slots past its end
    (the next sequence's, or zeros) come after every one of its tokens, so causal attention never lets its tokens
    see them, and their own outputs are dropped. Exact, with no mask; short sequences of many lengths share a few
    calls."""
    rows, heads, length, dim = query.shape
    if position_ids is None:
        raise ValueError("sdpa_varlen: the model passed no position ids to its attention")
    plan = _plan(position_ids, attention_mask, rows, length)

    def flat(t: torch.Tensor) -> torch.Tensor:  # B x H x T x D -> H x (B·T + widest) x D, zeros after the end
        return F.pad(t.transpose(0, 1).reshape(t.shape[1], rows * length, dim), (0, 0, 0, plan.widest))

    q, k, v = flat(query), flat(key), flat(value)
    pieces = []
    for index, real in plan.windows:
        q_s, k_s, v_s = (_sequences(t, index) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=scaling,
                                             dropout_p=dropout if module.training else 0.0, enable_gqa=True)
        pieces.append(out.transpose(0, 1).reshape(heads, index.numel(), dim)[:, real])
    out = torch.cat(pieces, dim=1)[:, plan.inverse]  # H x (B·T) x D in the row layout
    return out.reshape(heads, rows, length, dim).permute(1, 2, 0, 3), None


@dataclass
class _Plan:
    """Where the sequences of one layout are: per window, their slots (n x window) and which of those are their
    own; the order that puts the outputs back in the row layout; the widest window."""

    windows: list[tuple[torch.Tensor, torch.Tensor]]
    inverse: torch.Tensor
    widest: int


# The last layout's plan: every layer of one forward (and its backward's recompute) gets the same position ids and
# mask tensors, so their sequence boundaries (a host sync on a GPU) and gather indices are computed once, not once
# a layer. Keyed by the tensors themselves (held here, so no other tensor can take their id) and their versions.
_last: tuple[tuple[torch.Tensor, torch.Tensor | None, tuple], _Plan] | None = None


def _plan(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: int, length: int) -> _Plan:
    global _last
    versions = (position_ids._version, None if attention_mask is None else attention_mask._version, rows, length)
    if _last is not None:
        (last_ids, last_mask, last_versions), plan = _last
        if last_ids is position_ids and last_mask is attention_mask and last_versions == versions:
            return plan
    device = position_ids.device
    bounds = sequence_bounds(position_ids, attention_mask, rows, length)
    by_window: dict[int, list[tuple[int, int]]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        by_window.setdefault(bucket(end - start), []).append((start, end - start))
    windows, order = [], []
    for window, sequences in by_window.items():
        starts, sizes = torch.tensor(sequences, device=device).T
        offsets = torch.arange(window, device=device)
        index = starts[:, None] + offsets
        real = (offsets < sizes[:, None]).reshape(-1)  # the sequences' own slots
        windows.append((index, real))
        order.append(index.reshape(-1)[real])
    inverse = torch.empty(rows * length, dtype=torch.long, device=device)
    gathered = torch.cat(order)
    inverse[gathered] = torch.arange(len(gathered), device=device)
    plan = _Plan(windows, inverse, max(by_window))
    _last = ((position_ids, attention_mask, versions), plan)
    return plan


def _sequences(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """H x (B·T) x D, and n sequences' slots (n x length) -> the sequences as a batch, n x H x length x D."""
    count, length = index.shape
    return t[:, index.reshape(-1)].reshape(t.shape[0], count, length, t.shape[-1]).transpose(0, 1)
