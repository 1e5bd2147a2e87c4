"""The learner on a GPU: trained tokens/s, step time and peak GPU memory of the real learner path on an agent-sized
model and agent-shaped batches, next to a bare torch loop over the very same micro-batches, in one invocation.

  ours       learner.step.train_on_items on a DeepSpeed engine from learner.engine.build_engine (learner.device
             auto: the GPU; learner.precision auto: bf16 weights and activations, fp32 master weights and AdamW
             state; ZeRO stage and activation checkpointing from the config): balanced shards, packed rows,
             token-budgeted micro-batches, the project's loss (IS weights, entropy bonus), gradient clipping.
  bare       a copy of the same model in plain torch: bf16 autocast over fp32 weights, masked NLL of the same packed
             micro-batches (position ids), torch's fused AdamW. The yardstick of what the GPU does with no framework.
  bare_same  the same bare copy with the learner's whole math (the project's loss, clipping): the gap to `ours` is
             the framework alone (planning, collating, finite checks, DeepSpeed's wrappers).

The model is the tiny Llama of async_rl/model.py at agent size (by default 24 layers, hidden 1024, 16 heads,
8 KV heads, MLP 5504: ~0.5B parameters), random weights, the trap environment's vocabulary. Batches are seeded
random TrainItems with long-tailed lengths (a lognormal around --mean-tokens, capped at model.max_seq_len), an
agent's mix of observation (masked out) and action tokens (trained), mixed advantages. Wall clock with
torch.cuda.synchronize; ours and the bare loops alternate in rounds and a ratio is the median over back-to-back
pairs. Peak memory: torch.cuda.max_memory_allocated while the learner alone is on the GPU (weights, master
weights, optimizer state, gradients, activations). MFU counts 6 x parameters x tokens (attention's own FLOPs left
out) against the card's dense bf16 peak.

    python benchmarks/gpu_learner.py                 # on a GPU: ~2 minutes (0.5B model, 4 batches x 3 rounds)
    python benchmarks/gpu_learner.py --set learner.activation_checkpointing=true
    python benchmarks/gpu_learner.py --quick         # anywhere: a small model on whatever device there is

The last stdout line is JSON: {"device", "parameters", "ours_tokens_per_s", "ratio", "same_math_ratio",
"peak_gib", "mfu", ...}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import paired_ratio  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out" / "gpu_learner"
AGENT_MODEL = ["model.hidden_size=1024", "model.num_layers=24", "model.num_heads=16", "model.num_kv_heads=8",
               "model.intermediate_size=5504", "model.max_seq_len=4096"]
QUICK_MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=256", "model.max_seq_len=512"]
# Dense bf16 peak of the cards we plan for (NVIDIA's datasheets, SXM); MFU is left out on any other device.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def agent_items(vocab: int, count: int, mean_tokens: int, max_tokens: int, seed: int) -> list:
    """`count` TrainItems shaped like an agent's: lengths lognormal around `mean_tokens` (a long tail, capped at
    `max_tokens`), each a run of observation blocks (not trained) and action blocks (trained, ~30% of tokens)."""
    from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem, pack

    rng = np.random.default_rng(seed)
    items = []
    for n in range(count):
        length = int(min(max_tokens, max(16, rng.lognormal(np.log(mean_tokens), 0.6))))
        mask = np.zeros(length, dtype=int)
        position = int(rng.integers(8, 64))  # the prompt
        while position < length:
            action = int(rng.integers(8, 96))
            mask[position:position + action] = 1
            position += action + int(rng.integers(32, 256))  # the tool's output
        mask[-1] = 1
        items.append(TrainItem(
            item_id=n, kind="correction" if n % 3 == 0 else "immediate", group_id=f"g{n // 8}",
            trajectory_id=f"t{n}", tokens=pack(rng.integers(3, vocab, length).tolist(), TOKEN),
            loss_mask=pack(mask.tolist(), MASK), advantages=pack((rng.normal(size=length) * mask).tolist(), ADVANTAGE),
            behaviour_logprobs=pack((rng.uniform(-4, -0.1, length) * mask).tolist(), LOGPROB),
            policy_versions=pack([0] * length, TOKEN),
        ))
    return items


def measure(overrides: list[str], batches: int, items_per_batch: int, mean_tokens: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    from async_rl.config_load import load_config
    from async_rl.loss import policy_loss, token_logprobs_and_entropy
    from async_rl.model import load_model
    from async_rl.protocol import MASK, unpack
    from learner.attention import use_attention
    from learner.engine import build_engine
    from learner.settings import LearnerSettings
    from learner.step import layout_metrics, rank_micro_batches, train_on_items
    from rollout.prepare import prepare_model_dir
    from rollout.settings import RolloutSettings

    run_dir = tempfile.mkdtemp(prefix="run-", dir=OUT)  # a fresh model directory for this invocation's sizes
    config = load_config(None, [f"run.dir={run_dir}", "run.name=learner", "wandb.mode=disabled", "replay.durable=false",
                                "algo.entropy_coef=0.01", *overrides])
    model_dir = prepare_model_dir(RolloutSettings.from_config(config).model_dir)
    settings = LearnerSettings.from_config(config)
    engine, reference = build_engine(settings.engine, model_dir)
    device = engine.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    vocab = engine.module.config.vocab_size
    parameters = sum(p.numel() for p in engine.module.parameters())
    data = [agent_items(vocab, items_per_batch, mean_tokens, config.model.max_seq_len, seed) for seed in range(batches)]
    tokens = sum(item.num_tokens() for items in data for item in items)
    trained = sum(int(unpack(item.loss_mask, MASK).sum()) for items in data for item in items)
    layout = [layout_metrics(items, 1, settings.step.layout) for items in data]

    def ours(version: int = 0) -> None:
        for items in data:
            version, _ = train_on_items(engine, reference, items, version, settings.step)
        sync()

    started = time.perf_counter()
    ours()  # warm-up (allocator, kernels' autotuning), then one round with the learner alone on the device
    print(f"warm-up round {time.perf_counter() - started:.1f} s ({tokens:,} tokens)", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    ours()
    alone_s = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else None
    print(f"ours alone {alone_s:.1f} s: {tokens / alone_s:,.0f} tokens/s, peak "
          + (f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a"), flush=True)

    micro = [[batch.to(device) for batch, _ in rank_micro_batches(items, 0, 1, settings.step)] for items in data]
    attention = engine.module.config._attn_implementation  # learner.attention resolved (learner/attention.py)
    bare = load_model(model_dir).to(device).train()
    use_attention(bare, attention)  # the learner's attention kernel: the same work
    optimizer = torch.optim.AdamW(bare.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay,
                                  fused=True)
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32

    def bare_loop(same_math: bool) -> None:
        algo = config.algo
        for batches_of_step in micro:
            for t in batches_of_step:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16):
                    logits = bare(**t.model_inputs()).logits
                if same_math:
                    logp, entropy = token_logprobs_and_entropy(logits.float(), t.tokens, config.rollout.temperature,
                                                               entropy=algo.entropy_coef > 0)
                    loss, _ = policy_loss(logp, t.behaviour_logp, t.advantages, t.staleness(0), t.loss_mask, algo,
                                          entropy=entropy)
                else:
                    logits = logits[:, :-1].float()
                    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.tokens[:, 1:].reshape(-1),
                                          reduction="none")
                    loss = (nll * t.loss_mask.reshape(-1)).sum() / t.loss_mask.sum()
                loss.backward()
            if same_math:
                torch.nn.utils.clip_grad_norm_(bare.parameters(), config.learner.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()

    runs = {"ours": ours, "bare": lambda: bare_loop(False), "bare_same": lambda: bare_loop(True)}
    for name, run in runs.items():
        if name != "ours":
            run()  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            wall[name].append(time.perf_counter() - started)
    ours_s = statistics.median(wall["ours"])
    result = {
        "device": torch.cuda.get_device_name() if cuda else str(device), "torch": torch.__version__,
        "parameters": parameters, "precision": "bf16" if engine.bfloat16_enabled() else "fp32", "attention": attention,
        "zero_stage": config.learner.zero_stage, "activation_checkpointing": config.learner.activation_checkpointing,
        "batches": batches, "items_per_batch": items_per_batch, "tokens_per_batch": tokens / batches,
        "trained_tokens_per_batch": trained / batches,
        "micro_batches_per_batch": statistics.mean(m["micro_batches"] for m in layout),
        "padding_frac": statistics.mean(m["padding_frac"] for m in layout),
        "micro_batch_tokens": config.learner.micro_batch_tokens, "rounds_wall_s": wall, "alone_round_s": alone_s,
        "ours_tokens_per_s": tokens / ours_s, "ours_s_per_step": ours_s / batches,
        "bare_tokens_per_s": tokens / statistics.median(wall["bare"]),
        "bare_same_tokens_per_s": tokens / statistics.median(wall["bare_same"]),
        # time bare ÷ time ours = our tokens/s ÷ theirs
        "ratio": paired_ratio(wall["bare"], wall["ours"]), "same_math_ratio": paired_ratio(wall["bare_same"],
                                                                                            wall["ours"]),
        "peak_gib": peak / 2**30 if peak is not None else None,
        "weights_fp32_gib": parameters * 4 / 2**30,
    }
    peak_flops = next((f for card, f in PEAK_BF16_FLOPS.items() if card in result["device"]), None)
    result["mfu"] = 6 * parameters * result["ours_tokens_per_s"] / peak_flops if peak_flops else None
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and batches: runs on any device")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (repeatable), after the model size, e.g. learner.zero_stage=3")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, 2 with --quick)")
    parser.add_argument("--batches", type=int, default=None, help="batches per round (default 4, 2 with --quick)")
    parser.add_argument("--items", type=int, default=None, help="items per batch (default 32, 4 with --quick)")
    parser.add_argument("--mean-tokens", type=int, default=None,
                        help="median item length in tokens (default 1024, 128 with --quick)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    OUT.mkdir(parents=True, exist_ok=True)
    quick = args.quick
    result = measure([*(QUICK_MODEL if quick else AGENT_MODEL), *args.set], batches=args.batches or (2 if quick else 4),
                     items_per_batch=args.items or (4 if quick else 32),
                     mean_tokens=args.mean_tokens or (128 if quick else 1024),
                     rounds=args.rounds or (2 if quick else 3))
    result.update(quick=quick, overrides=args.set, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"{result['device']}: {result['parameters'] / 1e6:.0f}M parameters, {result['precision']}, "
          f"ZeRO-{result['zero_stage']}, attention {result['attention']}; "
          f"{result['tokens_per_batch']:.0f} tokens per batch "
          f"({result['micro_batches_per_batch']:.1f} micro-batches, padding {result['padding_frac']:.1%})")
    print(f"  ours       {result['ours_tokens_per_s']:>10,.0f} tokens/s   {result['ours_s_per_step']:.3f} s/step")
    print(f"  bare       {result['bare_tokens_per_s']:>10,.0f} tokens/s   ours/bare {result['ratio']:.3f}")
    print(f"  bare_same  {result['bare_same_tokens_per_s']:>10,.0f} tokens/s   ours/bare_same "
          f"{result['same_math_ratio']:.3f}")
    if result["peak_gib"] is not None:
        print(f"  peak GPU memory (learner alone) {result['peak_gib']:.2f} GiB; MFU "
              + (f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a (unknown card)"))
    name = "gpu_learner" + ("-quick" if quick else "") + ("-set" if args.set else "")
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("device", "parameters", "precision", "attention", "ours_tokens_per_s",
                                             "ratio",
                                             "same_math_ratio", "peak_gib", "mfu", "padding_frac")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
