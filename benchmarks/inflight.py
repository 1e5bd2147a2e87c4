"""Trajectories in flight vs rollout throughput at a fixed tool latency (rollout.max_inflight).

One rollout worker's episode runner (rollout/runner.py) with the built-in torch engine on the tiny model plays the
trap environment, every step sleeping `--latency` seconds (a tool call), for `--seconds` per variant. The only
difference between variants is `max_inflight`, the number of trajectories the runner keeps going at once
(group size 16, so 16 is one group at a time, like the worker before this knob existed). The variants run
interleaved, round after round, in one process (the machine is shared and noisy); each figure is the median over
rounds. No learner: this isolates the rollout side, which is what `max_inflight` changes.

    python benchmarks/inflight.py                 # 16/32/64/128 in flight, 3 rounds x 20 s each, 50 ms tools
    python benchmarks/inflight.py --quick         # 16 and 64, 1 round x 4 s
    python benchmarks/inflight.py --latency 0 --engine-batch-wait-s 0   # instant tools, calls not gathered
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import OUT_DIR, emit, machine, markdown_table, print_table  # noqa: E402

from async_rl.config_load import load_config  # noqa: E402
from async_rl.model import load_tokenizer  # noqa: E402
from rollout.engines.torch_engine import TorchEngine  # noqa: E402
from rollout.prepare import load_env, prepare_model_dir  # noqa: E402
from rollout.runner import EpisodeRunner  # noqa: E402
from rollout.settings import RolloutSettings  # noqa: E402


class Count:
    def __init__(self) -> None:
        self.stages = self.trajectories = 0

    def stage(self, episode, generation, reward, terminal) -> None:  # noqa: ANN001 - the Sink protocol
        self.stages += 1

    def outcome(self, episode, judgement, reason) -> None:  # noqa: ANN001
        self.trajectories += judgement is not None  # judged; not those cut off when the clock runs out


def measure(settings: RolloutSettings, factory, engine, tokenizer, inflight: int, seconds: float) -> dict:
    sink = Count()
    runner = EpisodeRunner.from_settings(settings.runner, settings.env.name, factory, engine, tokenizer, sink,
                                         max_inflight=inflight)
    tasks = factory.tasks("train")
    group = settings.worker.group_size
    started, n = time.monotonic(), 0
    with torch.inference_mode():
        while time.monotonic() - started < seconds:
            while runner.room_for(group):
                runner.start_group(f"g{n}", tasks[n % len(tasks)], group)
                n += 1
            runner.pump(0.01)
    elapsed = time.monotonic() - started
    calls = max(1, runner.engine_calls)
    result = {"trajectories_per_s": sink.trajectories / elapsed, "stages_per_s": sink.stages / elapsed,
              "engine_calls_per_s": calls / elapsed, "rows_per_call": sink.stages / calls}
    runner.abandon_all("benchmark over")
    runner.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per environment step (default 0.05)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per variant and round (default 20)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 and 64 in flight, 1 round of 4 s")
    parser.add_argument("--engine-batch-wait-s", type=float, default=None,
                        help="rollout.engine_batch_wait_s (default the config's; 0: every call takes whoever waits)")
    args = parser.parse_args()
    variants = [16, 64] if args.quick else [16, 32, 64, 128]
    seconds, rounds = (4.0, 1) if args.quick else (args.seconds, args.rounds)
    torch.set_num_threads(1)
    logging.getLogger("async_rl.rollout").setLevel(logging.ERROR)  # the cut-off trajectories at each variant's end
    out = OUT_DIR / "inflight"
    wait = [] if args.engine_batch_wait_s is None else [f"rollout.engine_batch_wait_s={args.engine_batch_wait_s}"]
    config = load_config(None, [f"run.dir={out}", "run.name=model", f"env.kwargs.step_latency_s={args.latency}", *wait])
    settings = RolloutSettings.from_config(config)
    factory = load_env(settings.env)
    model_dir = prepare_model_dir(settings.model_dir, factory)
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(model_dir, seed=0)
    results: dict[int, list[dict]] = {v: [] for v in variants}
    for _ in range(rounds):
        for inflight in variants:
            results[inflight].append(measure(settings, factory, engine, tokenizer, inflight, seconds))
    median = {v: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for v, runs in results.items()}
    base = median[variants[0]]["trajectories_per_s"]
    columns = ["max_inflight", "trajectories/s", "× 16 in flight", "stages/s", "engine calls/s", "rows per call"]
    rows = [[str(v), f"{m['trajectories_per_s']:.1f}", f"{m['trajectories_per_s'] / base:.2f}",
             f"{m['stages_per_s']:.1f}", f"{m['engine_calls_per_s']:.1f}", f"{m['rows_per_call']:.1f}"]
            for v, m in median.items()]
    command = "python benchmarks/inflight.py" + (" --quick" if args.quick else "")
    print_table(f"trajectories in flight, {args.latency * 1000:.0f} ms per tool call (median of {rounds})",
                columns, rows)
    print(markdown_table(columns, rows, command))
    emit({"latency_s": args.latency, "seconds": seconds, "rounds": rounds, "machine": machine(),
          "trajectories_per_s": {str(v): round(m["trajectories_per_s"], 2) for v, m in median.items()},
          "speedup_vs_16": {str(v): round(m["trajectories_per_s"] / base, 3) for v, m in median.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
