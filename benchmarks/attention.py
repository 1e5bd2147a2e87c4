"""Packed attention: forward + backward tokens/s of each learner.attention choice that runs here against today's
dense block-diagonal mask (`dense`), side by side in one invocation, on packed rows of the learner's own layout.

Rows are collated by learner/batch.py (position ids restarting per sequence, no
attention mask) from seeded random sequences, in two length mixes: `short` (8-64 tokens: the trap and the hunt)
and `agent` (32-1024 tokens, log-uniform: multi-turn agents). The model is the tiny Llama of async_rl/model.py built
from a config (by default 4 layers, hidden 256, 4 heads, 2 KV heads, MLP 688, random weights). Each timed run is
one forward and backward of the masked next-token NLL over every row of the mix; the implementations alternate
within each round, and a speed-up is the median over rounds of dense's time ÷ the implementation's (back-to-back
pairs: a shared machine's load changes between rounds, much less within one). On CPU the time is CPU seconds of
this process on one thread (time.process_time: another tenant's load does not count against us), the wall-clock
rate printed next to it; on a GPU wall clock with torch.cuda.synchronize, bf16 autocast. Every implementation's
loss is checked against dense's before timing.

    python benchmarks/attention.py              # 4,096-token rows, 5 rounds: ~2 minutes of CPU on one core
    python benchmarks/attention.py --quick      # 512-token rows, a 1-layer model: a few seconds

The last stdout line is JSON: {"device", "row_tokens", "implementations", "tokens_per_s", "speedup", ...}, tokens/s
and speed-ups keyed by mix, then implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, paired_ratio, print_table  # noqa: E402 - benchmarks/ is not a package

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=688", "model.max_seq_len=4096"]
QUICK_MODEL = ["model.hidden_size=64", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
               "model.intermediate_size=128", "model.max_seq_len=512"]
MIXES = {"short": (8, 64), "agent": (32, 1024)}  # sequence lengths, drawn log-uniform between the two
VOCAB = 512


def mix_items(low: int, high: int, tokens: int, seed: int) -> list:
    """Seeded TrainItems of log-uniform lengths in [low, high] summing to `tokens` (the last one cut to fit)."""
    from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem, pack

    rng = np.random.default_rng(seed)
    items, total = [], 0
    while total < tokens:
        n = min(int(np.exp(rng.uniform(np.log(low), np.log(high + 1)))), tokens - total)
        n = max(n, min(2, tokens - total))
        mask = np.ones(n, dtype=int)
        mask[0] = 0
        items.append(TrainItem(
            item_id=len(items), kind="immediate", group_id="g", trajectory_id=f"t{len(items)}",
            tokens=pack(rng.integers(3, VOCAB, n).tolist(), TOKEN), loss_mask=pack(mask.tolist(), MASK),
            advantages=pack([1.0] * n, ADVANTAGE), behaviour_logprobs=pack([-1.0] * n, LOGPROB),
            policy_versions=pack([0] * n, TOKEN)))
        total += n
    return items


def packed_rows(low: int, high: int, row_tokens: int, rows: int):  # noqa: ANN201 - a TrainBatch
    """`rows` full rows of the learner's layout (learner/batch.py: end to end, position ids restarting per
    sequence), each of seeded sequences filling exactly row_tokens."""
    from learner.batch import collate_rows

    items, layout = [], []
    for row in range(rows):
        these = mix_items(low, high, row_tokens, seed=row)
        layout.append(list(range(len(items), len(items) + len(these))))
        items += these
    return collate_rows(items, layout, packed=True)


def implementations_here(cuda: bool) -> list[str]:
    """learner.attention choices that can train here: flex and flash need a GPU (flash also flash_attn)."""
    from learner.attention import flash_attn_installed

    return ["dense", "varlen"] + (["flex"] if cuda else []) + (["flash"] if cuda and flash_attn_installed() else [])


def measure(overrides: list[str], row_tokens: int, rows: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    from async_rl.config_load import load_config
    from async_rl.model import build_tiny_model
    from learner.attention import select_attention, use_attention

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.set_num_threads(1)
    config = load_config(None, ["wandb.mode=disabled", *overrides])
    model = build_tiny_model(config.model, config.run.seed, VOCAB, 0, 1).to(device).train()
    dtype = torch.bfloat16 if cuda else torch.float32
    names = implementations_here(cuda)
    batches = {mix: packed_rows(low, high, row_tokens, rows).to(device)
               for mix, (low, high) in MIXES.items()}

    def step(mix: str) -> float:
        batch = batches[mix]
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype, enabled=cuda):
            logits = model(**batch.model_inputs()).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, VOCAB), batch.tokens[:, 1:].reshape(-1), reduction="none")
        loss = (nll * batch.loss_mask.reshape(-1)).sum() / batch.loss_mask.sum()
        loss.backward()
        return float(loss.detach())

    def timed(name: str, mix: str) -> tuple[float, float, float]:
        use_attention(model, select_attention(name, device, True))
        if cuda:
            torch.cuda.synchronize()
        cpu, wall = time.process_time(), time.perf_counter()
        loss = step(mix)
        if cuda:
            torch.cuda.synchronize()
        return time.process_time() - cpu, time.perf_counter() - wall, loss

    losses = {mix: {name: timed(name, mix)[2] for name in names} for mix in MIXES}  # warm-up and the check
    for mix, by_name in losses.items():
        for name, loss in by_name.items():
            if abs(loss - by_name["dense"]) > (2e-2 if cuda else 1e-4) * abs(by_name["dense"]):
                raise SystemExit(f"attention {name} on the {mix} mix: loss {loss} != dense's {by_name['dense']}")
    cpu = {mix: {name: [] for name in names} for mix in MIXES}
    wall = {mix: {name: [] for name in names} for mix in MIXES}
    for _ in range(rounds):
        for mix in MIXES:
            for name in names:
                c, w, _ = timed(name, mix)
                cpu[mix][name].append(c)
                wall[mix][name].append(w)
    timing = wall if cuda else cpu
    slots = rows * row_tokens
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "clock": "wall" if cuda else "cpu",
        "torch": torch.__version__, "row_tokens": row_tokens, "rows": rows, "rounds": rounds,
        "parameters": sum(p.numel() for p in model.parameters()), "implementations": names,
        "sequences_per_row": {mix: int((b.position_ids == 0).sum()) / rows for mix, b in batches.items()},
        "losses": losses,
        "tokens_per_s": {mix: {n: slots / statistics.median(timing[mix][n]) for n in names} for mix in MIXES},
        "wall_tokens_per_s": {mix: {n: slots / statistics.median(wall[mix][n]) for n in names} for mix in MIXES},
        # dense's time ÷ the implementation's, per round: its tokens/s ÷ dense's
        "speedup": {mix: {n: paired_ratio(timing[mix]["dense"], timing[mix][n]) for n in names} for mix in MIXES},
        "speedup_range": {mix: {n: speedup_range(timing[mix]["dense"], timing[mix][n]) for n in names}
                          for mix in MIXES},
        "seconds": timing,
    }


def speedup_range(dense: list[float], other: list[float]) -> list[float]:
    """The lowest and highest per-round speed-up (dense's time ÷ the other's)."""
    ratios = [d / t for d, t in zip(dense, other, strict=True)]
    return [min(ratios), max(ratios)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512-token rows, a 1-layer model, 2 rounds")
    parser.add_argument("--row-tokens", type=int, default=None, help="packed row length (default 4096)")
    parser.add_argument("--rows", type=int, default=1, help="rows per forward (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, 2 with --quick)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override after the model size, e.g. model.num_layers=8")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    row_tokens = args.row_tokens or (512 if args.quick else 4096)
    model = QUICK_MODEL if args.quick else MODEL
    result = measure([*model, f"model.max_seq_len={row_tokens}", *args.set], row_tokens, args.rows,
                     args.rounds or (2 if args.quick else 5))
    result.update(quick=args.quick, overrides=args.set, machine=machine())
    rows = []
    for mix in MIXES:
        for name in result["implementations"]:
            low, high = result["speedup_range"][mix][name]
            rows.append([mix, f"{result['sequences_per_row'][mix]:.1f}", name,
                         f"{result['tokens_per_s'][mix][name]:,.0f}", f"{result['wall_tokens_per_s'][mix][name]:,.0f}",
                         f"{result['speedup'][mix][name]:.2f} ({low:.2f}-{high:.2f})"])
    clock = "CPU" if result["clock"] == "cpu" else "wall"
    print_table(f"packed attention, {row_tokens}-token rows x {args.rows}, {result['device']}, "
                f"{result['parameters'] / 1e6:.1f}M parameters, forward + backward",
                ["mix", "sequences/row", "attention", f"tokens/{clock} s", "tokens/wall s",
                 "÷ dense (median, range)"], rows)
    print(json.dumps({k: result[k] for k in ("device", "clock", "row_tokens", "rows", "implementations",
                                             "sequences_per_row", "tokens_per_s", "speedup")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
