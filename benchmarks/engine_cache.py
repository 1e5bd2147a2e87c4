"""Multi-turn rollouts with and without the built-in engine's cache between turns (`rollout.prefix_cache_mib`).

A batch of trajectories plays `--turns` turns: each turn the engine samples `--action` tokens and the context grows
by them and an `--observation` of random tokens, as an agent's context grows with its tool results. Without the
cache every turn prefills the whole context again; with it a turn feeds only what is new. The model has SmolLM2-135M's
architecture (30 layers, hidden 576, 9 heads, 3 key/value heads, vocab 49,152) with random weights: the speed of a
forward pass does not depend on the weights, and no model hub is needed. Both variants run interleaved, round after
round, in one process (the machine is shared and noisy); each figure is a median over rounds with its range. That
the cached log-probs equal one full forward pass is tests/test_engine_cache.py's job, not this script's.

    python benchmarks/engine_cache.py          # 8 trajectories x 8 turns, 128-token prompt, 24+32 a turn, 3 rounds
    python benchmarks/engine_cache.py --quick  # 2 layers, 2 trajectories x 3 turns of 8+16 tokens, 1 round
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, emit, machine, markdown_table, print_table  # noqa: E402

from async_rl.config_load import load_config  # noqa: E402
from rollout.engines import SamplingParams  # noqa: E402
from rollout.engines.torch_engine import TorchEngine  # noqa: E402
from rollout.prepare import prepare_model_dir  # noqa: E402
from rollout.settings import RolloutSettings  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)


def model_dir(out: Path, layers: int) -> Path:
    """SmolLM2-135M's architecture, random weights, with the tiny model's tokenizer (used only for stop strings)."""
    path = out / f"smollm2-shape-{layers}"
    if (path / "config.json").exists():
        return path
    tiny_config = load_config(None, [f"run.dir={out}", "run.name=tiny"])
    tiny = prepare_model_dir(RolloutSettings.from_config(tiny_config).model_dir)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers})).save_pretrained(path)
    for name in tiny.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(name, path / name.name)
    return path


def episode(engine: TorchEngine, args: argparse.Namespace, seed: int) -> float:
    """Wall seconds for one batch of trajectories to play every turn."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    contexts = [[rng.randrange(4, vocab) for _ in range(args.prompt)] for _ in range(args.trajectories)]
    params = SamplingParams(max_new_tokens=args.action)
    engine.generator.manual_seed(seed)
    started = time.perf_counter()
    for _ in range(args.turns):
        for row, generation in enumerate(engine.generate(contexts, params)):
            contexts[row] += generation.token_ids + [rng.randrange(4, vocab) for _ in range(args.observation)]
    engine.cache.clear()  # the next episode starts cold, like a new group
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128, help="tokens of the first prompt (default 128)")
    parser.add_argument("--action", type=int, default=24, help="tokens sampled a turn (default 24)")
    parser.add_argument("--observation", type=int, default=32, help="tokens added after each action (default 32)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, 2 trajectories x 3 turns of 8+16 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.trajectories, args.turns, args.rounds = 2, 2, 3, 1
        args.prompt, args.action, args.observation = 64, 8, 16
    torch.set_num_threads(1)
    out = OUT_DIR / "engine_cache"
    path = model_dir(out, args.layers)
    engines = {"re-prefill": TorchEngine(path, seed=0), "cache": TorchEngine(path, seed=0, cache_mib=4096)}
    walls: dict[str, list[float]] = {name: [] for name in engines}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for name, engine in engines.items():
                walls[name].append(episode(engine, args, seed=round_))
    stats = engines["cache"].cache.stats
    median = {name: statistics.median(w) for name, w in walls.items()}
    ratio = median["cache"] / median["re-prefill"]
    columns = ["engine", "episode s (median)", "range", "× re-prefill"]
    rows = [[name, f"{median[name]:.2f}", f"{min(w):.2f}–{max(w):.2f}", f"{median[name] / median['re-prefill']:.2f}"]
            for name, w in walls.items()]
    command = "python benchmarks/engine_cache.py" + (" --quick" if args.quick else "")
    print_table(f"{args.trajectories} trajectories x {args.turns} turns, SmolLM2-135M's shape at {args.layers} layers "
                f"(median of {args.rounds})", columns, rows)
    print(markdown_table(columns, rows, command))
    emit({"machine": machine(), "layers": args.layers, "trajectories": args.trajectories, "turns": args.turns,
          "prompt": args.prompt, "action": args.action, "observation": args.observation, "rounds": args.rounds,
          "episode_s": {name: [round(w, 3) for w in ws] for name, ws in walls.items()},
          "wall_ratio": round(ratio, 3), "reuse_frac": round(stats.reuse_frac(), 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
