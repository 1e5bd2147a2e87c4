"""LoRA against full fine-tune in the learner: memory and seconds per step on the same batches, in one invocation.

Each arm is the real learner path (learner.engine.build_engine, learner.step.train_on_items: DeepSpeed, the
project's loss, AdamW) on the same model and the same seeded batches, in a child process of its own so that its
peak RSS is its own; they run one after the other (full fine-tune first). Per arm:

  s_per_step         median wall time of the timed steps (after --warmup untimed ones)
  peak_rss_mib       the process's peak resident memory (ru_maxrss), and over_imports_mib, the same less the RSS
                     after importing torch, DeepSpeed, transformers and peft (what the model and training added)
  state_mib          parameters + gradients + optimizer state (exact tensor bytes): what LoRA is meant to cut
  trainable          parameters in the optimizer

The lora arm also times what the learner publishes per version, median of --publish-runs writes: the merged full
weights (an hf-v<N>/ directory, what every engine loads) against the adapters alone (a lora-v<N>/ PEFT directory,
what vLLM servers load under rollout.vllm.lora: adapter): publish_merged_s / _mib, publish_adapter_s / _mib.

The ratios are LoRA's over the full fine-tune's. With --set algo.kl_beta=0.05 the full fine-tune also holds a frozen
reference copy of the model, which LoRA does not (its reference is the base with the adapter off).

    python benchmarks/lora.py --quick                      # the tiny model, seconds (run by tests/test_lora.py)
    python benchmarks/lora.py --model DIR --steps 2 --items 2 --item-tokens 256

The last stdout line is JSON: {"model", "parameters", "tokens_per_step", "full", "lora", "ratios"}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK_MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=256", "model.max_seq_len=512"]


def rss_mib() -> float:
    """The current resident set size (Linux /proc), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def batches(vocab: int, steps: int, items: int, item_tokens: int) -> list[list]:
    """`steps` batches of `items` TrainItems of exactly `item_tokens` tokens each, seeded by step: a prompt, then
    alternating action blocks (trained) and tool output (not), mixed advantages, behaviour log-probs near -2."""
    import numpy as np

    from async_rl.protocol import ADVANTAGE, LOGPROB, MASK, TOKEN, TrainItem, pack

    out = []
    for step in range(steps):
        rng = np.random.default_rng(step)
        batch = []
        for n in range(items):
            mask = np.zeros(item_tokens, dtype=int)
            position = item_tokens // 8
            while position < item_tokens:
                action = int(rng.integers(8, 48))
                mask[position:position + action] = 1
                position += action + int(rng.integers(16, 96))
            batch.append(TrainItem(
                item_id=n, kind="correction" if n % 2 else "immediate", group_id="g0", trajectory_id=f"t{step}-{n}",
                tokens=pack(rng.integers(3, vocab, item_tokens).tolist(), TOKEN), loss_mask=pack(mask.tolist(), MASK),
                advantages=pack((rng.normal(size=item_tokens) * mask).tolist(), ADVANTAGE),
                behaviour_logprobs=pack((rng.uniform(-3, -1, item_tokens) * mask).tolist(), LOGPROB),
                policy_versions=pack([0] * item_tokens, TOKEN),
            ))
        out.append(batch)
    return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(engine) -> int:
    """Bytes of the optimizer's state tensors (Adam's two moments) and of any fp32 master copies DeepSpeed holds."""
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    masters = [t for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
               for t in getattr(engine.optimizer, name, [])]
    return tensor_bytes(state) + tensor_bytes(masters)


def arm(args: argparse.Namespace) -> dict:
    """One arm in this process: build, warm up, time, measure."""
    import peft  # noqa: F401 - imported before the baseline RSS in both arms, so they subtract the same

    from async_rl.config_load import load_config
    from learner.engine import build_engine
    from learner.settings import LearnerSettings
    from learner.step import train_on_items
    from rollout.prepare import prepare_model_dir
    from rollout.settings import RolloutSettings

    imported = rss_mib()
    run_dir = tempfile.mkdtemp(prefix="lora-bench-")
    rank = args.rank if args.arm == "lora" else 0
    overrides = [f"run.dir={run_dir}", "run.name=bench", "wandb.mode=disabled", "learner.precision=fp32",
                 f"run.threads_per_process={args.threads}", f"learner.lora.rank={rank}",
                 f"learner.lora.alpha={args.alpha}", f"learner.micro_batch_tokens={args.items * args.item_tokens}",
                 *(QUICK_MODEL if args.model is None else [f"model.path={args.model}"]), *args.set]
    config = load_config(None, overrides)
    settings = LearnerSettings.from_config(config)
    model_dir = prepare_model_dir(RolloutSettings.from_config(config).model_dir)
    engine, reference = build_engine(settings.engine, model_dir)
    parameters = sum(p.numel() for p in engine.module.parameters())
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    data = batches(engine.module.config.vocab_size, args.warmup + args.steps, args.items, args.item_tokens)
    wall, version = [], 0
    for n, items in enumerate(data):
        started = time.perf_counter()
        version, _ = train_on_items(engine, reference, items, version, settings.step)
        if n >= args.warmup:
            wall.append(time.perf_counter() - started)
    publish = publishing(engine, settings, model_dir, args.publish_runs) if rank else {}
    reference_bytes = tensor_bytes(reference.parameters()) if hasattr(reference, "parameters") else 0
    state = (tensor_bytes(engine.module.parameters()) + tensor_bytes(trainable)  # weights, gradients
             + optimizer_state_bytes(engine) + reference_bytes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    engine.destroy()
    return {"arm": args.arm, "lora_rank": rank, "parameters": parameters,
            "trainable": sum(p.numel() for p in trainable), "steps_wall_s": wall,
            "s_per_step": statistics.median(wall), "peak_rss_mib": peak, "over_imports_mib": peak - imported,
            "state_mib": state / 2**20, "reference_mib": reference_bytes / 2**20, **publish}


def publishing(engine, settings, model_dir: Path, runs: int) -> dict:
    """Seconds (median of `runs`, each the gather and the directory written whole) and MiB of a version published
    merged (hf-v<N>/) and as adapters alone (lora-v<N>/)."""
    from async_rl.weights.hf_dir import write_adapter_dir, write_hf_dir
    from learner.engine import full_state_dict
    from learner.lora import adapter_config

    out = Path(tempfile.mkdtemp(prefix="lora-publish-"))
    adapter_json = adapter_config(settings.engine.lora, str(model_dir))
    ways = {"merged": lambda n: write_hf_dir(full_state_dict(engine), model_dir, out / f"hf-v{n}"),
            "adapter": lambda n: write_adapter_dir(full_state_dict(engine, adapters=True), adapter_json,
                                                   out / f"lora-v{n}")}
    result = {}
    for name, write in ways.items():
        wall = []
        for n in range(runs):
            started = time.perf_counter()
            directory = write(n)
            wall.append(time.perf_counter() - started)
        result[f"publish_{name}_s"] = statistics.median(wall)
        result[f"publish_{name}_range_s"] = [min(wall), max(wall)]
        result[f"publish_{name}_mib"] = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, small batches: seconds")
    parser.add_argument("--model", help="a Hugging Face model directory (default: the tiny model of async_rl/model.py)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the lora arm (default 16)")
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha of the lora arm (default 32)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per arm (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default 1)")
    parser.add_argument("--items", type=int, default=2, help="items per batch (default 2)")
    parser.add_argument("--item-tokens", type=int, default=256, help="tokens per item (default 256)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per arm (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both arms, e.g. algo.kl_beta=0.05 (repeatable)")
    parser.add_argument("--publish-runs", type=int, default=3, help="writes of each published form timed (default 3)")
    parser.add_argument("--arm", choices=["full", "lora"], help=argparse.SUPPRESS)  # a child process: one arm
    args = parser.parse_args()
    if args.model is not None and not (Path(args.model) / "config.json").exists():
        parser.error(f"--model: {args.model} is not a Hugging Face model directory (no config.json)")
    if args.rank < 1:
        parser.error("--rank: expected >= 1")
    if args.quick:
        args.steps, args.warmup, args.items, args.item_tokens = 2, 1, 2, 64
    if args.arm is not None:
        print(json.dumps(arm(args)))
        return 0
    results = {}
    shared = ("model", "rank", "alpha", "steps", "warmup", "items", "item_tokens", "threads", "publish_runs")
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in shared and v is not None]
    forwarded += [f"--set={s}" for s in args.set]
    for name in ("full", "lora"):
        print(f"{name}: {args.steps} timed step(s) of {args.items} x {args.item_tokens} tokens ...", flush=True)
        done = subprocess.run([sys.executable, __file__, f"--arm={name}", *forwarded], capture_output=True, text=True,
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            return done.returncode
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        print(f"  {r['s_per_step']:.2f} s/step, peak RSS {r['peak_rss_mib']:.0f} MiB ({r['over_imports_mib']:.0f} over "
              f"imports), weights+grads+optimizer {r['state_mib']:.1f} MiB, {r['trainable']:,} trained", flush=True)
    full, lora = results["full"], results["lora"]
    ratios = {key: lora[key] / full[key] for key in ("s_per_step", "peak_rss_mib", "over_imports_mib", "state_mib",
                                                      "trainable")}
    print("lora / full: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
    ratios["publish_adapter_over_merged_s"] = lora["publish_adapter_s"] / lora["publish_merged_s"]
    ratios["publish_adapter_over_merged_mib"] = lora["publish_adapter_mib"] / lora["publish_merged_mib"]
    print(f"published per version: merged {lora['publish_merged_mib']:.1f} MiB in {lora['publish_merged_s']:.3f} s, "
          f"adapters alone {lora['publish_adapter_mib']:.2f} MiB in {lora['publish_adapter_s']:.3f} s "
          f"({ratios['publish_adapter_over_merged_s']:.3f}x the time, {ratios['publish_adapter_over_merged_mib']:.4f}x "
          "the bytes)", flush=True)
    print(json.dumps({"model": args.model or "tiny", "parameters": full["parameters"],
                      "tokens_per_step": args.items * args.item_tokens, "full": full, "lora": lora,
                      "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
