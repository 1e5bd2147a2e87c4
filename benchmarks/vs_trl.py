"""async-rl versus TRL's GRPOTrainer: wall time and generated samples to the same success rate.

The peer a user would pick instead is TRL's `GRPOTrainer` (synchronous, on-policy GRPO: generate a batch, score
it, take a step). Both learn the same single-stage trap task from the same starting point:

  task    env.kwargs.stages=1 env.kwargs.traps=0 env.kwargs.retries=0: the prompt is `task7 stage1`, the completion
          is one token, and
          the reward is the trap environment's outcome (1.0 if the token is the task's code symbol, else 0);
  model   the very directory `prepare_model_dir` builds (word-level tokenizer + tiny Llama, random init,
          seeded by run.seed), loaded by both;
  update  group size 16 (TRL num_generations), learning rate 5e-4, AdamW without weight decay, gradient clip 1.0,
          constant schedule, no KL, temperature 1, 64 samples per TRL step (4 prompts x 16);
  target  success rate >= 0.8 over the last 512 finished samples (async-rl's replay.long_success_window, which
          its own stop rule uses), at least 512 samples in, checked once per optimizer step in both; time is
          measured from the moment the benchmark starts the process.

async-rl runs as `python -m launch.cli train` (learner, replay and one rollout worker: three processes);
TRL runs in one process (this file with --trl-child) on CPU (`use_cpu=True, bf16=False, use_vllm=False`).
Every process is pinned to one thread (OMP_NUM_THREADS=1). Seeds alternate between the systems in one invocation
(the machine is shared: the ratios are what to read, not the absolute seconds).

    python benchmarks/vs_trl.py            # 5 seeds
    python benchmarks/vs_trl.py --quick    # 1 seed, shorter time limit

Needs the `bench` extra (`pip install -e .[bench]`: trl, datasets). Without TRL it says so and exits 1.
The last stdout line is JSON: {"time_to_target_ratio": TRL / async-rl, "samples_ratio": TRL / async-rl, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out" / "vs_trl"
TASK = ["env.kwargs.stages=1", "env.kwargs.traps=0", "env.kwargs.retries=0"]
TARGET = 0.8
# Success over the last 512 finished samples (replay.long_success_window, async-rl's own stop rule), for both
# systems: over 64 (a few groups of a few tasks) a lucky window touches the target long before the policy does.
WINDOW = 512
GROUP_SIZE = 16
LR = 5e-4
SAMPLES_PER_STEP = 64  # TRL per_device_train_batch_size: 4 prompts x 16 completions (async-rl: 64-item batches)


def overrides(seed: int, run_dir: Path, model_dir: Path, max_wall_s: float) -> list[str]:
    return TASK + [
        f"run.seed={seed}", f"run.dir={run_dir}", f"run.name=seed{seed}", f"run.target_success={TARGET}",
        f"run.max_wall_s={max_wall_s}", f"model.path={model_dir}", f"rollout.group_size={GROUP_SIZE}",
        f"learner.lr={LR}", f"replay.long_success_window={WINDOW}", "wandb.mode=disabled", "run.log_level=WARNING",
    ]


def build_model(seed: int) -> Path:
    """One model directory per seed, shared by both systems (async-rl gets it as model.path)."""
    from async_rl.config_load import load_config
    from rollout.prepare import prepare_model_dir
    from rollout.settings import RolloutSettings

    config = load_config(None, TASK + [f"run.seed={seed}", f"run.dir={OUT}", f"run.name=model-seed{seed}"])
    return prepare_model_dir(RolloutSettings.from_config(config).model_dir)


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=str(REPO))


# --- async-rl ----------------------------------------------------------------------------------------


def run_async_rl(seed: int, model_dir: Path, max_wall_s: float) -> dict:
    """`async-rl train`; the target moment is when the learner's metrics line first shows it (polled at 10 Hz)."""
    run_dir = OUT / "async-rl" / time.strftime("%Y%m%d-%H%M%S")
    args = [sys.executable, "-m", "launch.cli", "train", *overrides(seed, run_dir, model_dir, max_wall_s)]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(run_dir / "launcher.log", "wb") as log_file:
        process = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=log_file)
        reached = None
        metrics_path = run_dir / f"seed{seed}" / "metrics.jsonl"
        while process.poll() is None:
            time.sleep(0.1)
            if reached is None:
                reached = _first_on_target(metrics_path, seen_s=time.time() - started)
        stdout = process.stdout.read().decode()
    if process.returncode != 0:
        raise RuntimeError(f"async-rl train exited {process.returncode}; see {run_dir / 'launcher.log'}")
    reached = reached or _first_on_target(metrics_path, seen_s=None)
    final = json.loads(stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    # metrics wall_s counts from the launcher's start; shift it to our clock (launch) using the target line
    shift = reached["time_to_target_s"] - reached["wall_s"] if reached else 0.0
    curve = [[r["env_steps"], r["wall_s"] + shift, r["success_rate_long"]] for r in rows
             if r["trajectories_finished"] >= WINDOW]
    result = {"system": "async-rl", "seed": seed, "final_success": final["final_success_rate"],
              "versions": final["versions"], "total_s": time.time() - started, "curve": curve}
    result.update(reached or {"time_to_target_s": None, "samples": None})
    return result


def _first_on_target(path: Path, seen_s: float | None) -> dict | None:
    """The first metrics line at the target; its time is `seen_s` (when we saw it) or, if None, its wall_s."""
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["trajectories_finished"] >= WINDOW and row["success_rate_long"] >= TARGET:
            return {"time_to_target_s": row["wall_s"] if seen_s is None else seen_s, "wall_s": row["wall_s"],
                    "samples": row["env_steps"], "versions_to_target": row["version"]}
    return None


# --- TRL ---------------------------------------------------------------------------------------------


def run_trl(seed: int, model_dir: Path, max_wall_s: float) -> dict:
    result_path = OUT / "trl" / f"seed{seed}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(child_env(), BENCH_LAUNCH=repr(time.time()))
    args = [sys.executable, __file__, "--trl-child", "--seed", str(seed), "--model-dir", str(model_dir),
            "--max-wall-s", str(max_wall_s), "--result", str(result_path)]
    log_path = result_path.with_suffix(".log")
    with open(log_path, "wb") as log_file:
        code = subprocess.run(args, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT).returncode
    if code != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the TRL run exited {code}; last lines of {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


def trl_child(seed: int, model_dir: Path, max_wall_s: float, result_path: Path) -> None:
    """One GRPOTrainer run; stops at the target (or the time limit) and writes its result as JSON."""
    launched = float(os.environ["BENCH_LAUNCH"])
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.config_load import load_config
    from async_rl.model import load_model, load_tokenizer
    from rollout.envs.base import Task
    from rollout.envs.trap import factory as trap_factory
    from rollout.envs.trap import stage_word, task_word

    torch.set_num_threads(1)
    env_factory = trap_factory(**load_config(None, TASK + [f"run.seed={seed}"]).env.kwargs)
    num_tasks = env_factory.settings.num_tasks
    recent: deque[float] = deque(maxlen=WINDOW)
    state = {"samples": 0, "steps": 0, "reached": None, "curve": []}

    def trap_outcome(prompts: list[str], completions: list[str], task_id: list[int], **_: object) -> list[float]:
        """The trap environment's outcome of a one-symbol answer (stages=1: the stage is the whole episode)."""
        rewards = []
        for completion, task in zip(completions, task_id, strict=True):
            env = env_factory.make()
            env.reset(Task(str(task), {"task": task}))
            env.step(completion)
            rewards.append(env.judge().score)
        recent.extend(rewards)
        state["samples"] += len(rewards)
        if len(recent) == WINDOW:
            state["curve"].append([state["samples"], time.time() - launched, sum(recent) / WINDOW])
        # Checked once per step, as async-rl's learner checks its replay's window once per step.
        if state["reached"] is None and len(recent) == WINDOW and sum(recent) / WINDOW >= TARGET:
            state["reached"] = {"time_to_target_s": time.time() - launched, "samples": state["samples"],
                                "versions_to_target": state["steps"]}
        return rewards

    class StopAtTarget(TrainerCallback):
        def on_step_end(self, args, trainer_state, control, **kwargs):  # noqa: ANN001 - the callback's signature
            state["steps"] = trainer_state.global_step
            if state["reached"] is not None or time.time() - launched >= max_wall_s:
                control.should_training_stop = True
            return control

    prompts = [f"{task_word(t)} {stage_word(0)}" for t in range(num_tasks)]
    repeats = 4000  # more prompts than any run reaches; the trainer shuffles them with `seed`
    dataset = Dataset.from_dict({"prompt": prompts * repeats, "task_id": list(range(num_tasks)) * repeats})
    config = GRPOConfig(
        output_dir=str(result_path.parent / f"trainer-seed{seed}"), use_cpu=True, bf16=False, use_vllm=False,
        seed=seed, data_seed=seed, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        lr_scheduler_type="constant", num_generations=GROUP_SIZE, per_device_train_batch_size=SAMPLES_PER_STEP,
        steps_per_generation=1, num_iterations=1, beta=0.0, temperature=1.0, top_p=1.0, max_completion_length=1,
        max_steps=10**6, num_train_epochs=1, logging_steps=10**6, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=load_model(model_dir), reward_funcs=trap_outcome, args=config, train_dataset=dataset,
        processing_class=load_tokenizer(model_dir), callbacks=[StopAtTarget()],
    )
    trainer.train()
    reached = state["reached"] or {"time_to_target_s": None, "samples": None, "versions_to_target": None}
    final = sum(recent) / len(recent) if recent else 0.0
    result = {"system": "TRL", "seed": seed, "final_success": final, "versions": state["steps"],
              "total_s": time.time() - launched, "curve": state["curve"], **reached}
    result_path.write_text(json.dumps(result))


# --- the comparison ----------------------------------------------------------------------------------


def trl_missing() -> str | None:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as exc:
        return f"TRL is not installed ({exc}); install the bench extra: pip install -e '.[bench]'"
    return None


def ratio(trl_value: float | None, ours: float | None) -> float | None:
    return trl_value / ours if trl_value is not None and ours else None


def table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Table(title=f"time and samples to success >= {TARGET} over the last {WINDOW} samples (single-stage trap)")
    columns = ("system", "seed", "time to target (s)", f"first {WINDOW} scored → target (s)", "samples to target",
               "steps to target", "final", "run (s)")
    for column in columns:
        out.add_column(column, justify="right")
    for r in results:
        t, learning = r["time_to_target_s"], r["window_to_target_s"]
        out.add_row(r["system"], str(r["seed"]), f"{t:.1f}" if t is not None else "not reached",
                    f"{learning:.1f}" if learning is not None else "-",
                    str(r["samples"]) if r["samples"] is not None else "-", str(r.get("versions_to_target", "-")),
                    f"{r['final_success']:.3f}", f"{r['total_s']:.1f}")
    Console(width=160).print(out)


def plot(results: list[dict], path: Path) -> None:
    """Success over the last WINDOW samples against generated samples and against wall time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colours = {"async-rl": "tab:blue", "TRL": "tab:orange"}
    for r in results:
        samples, seconds, success = zip(*r["curve"], strict=True) if r["curve"] else ((), (), ())
        label = r["system"] if r["seed"] == results[0]["seed"] else None
        axes[0].plot(samples, success, color=colours[r["system"]], alpha=0.7, label=label)
        axes[1].plot(seconds, success, color=colours[r["system"]], alpha=0.7, label=label)
    for ax, xlabel in zip(axes, ("generated samples", "wall time since launch (s), shared 2-core CPU"), strict=True):
        ax.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"success rate, last {WINDOW} samples")
    axes[0].legend()
    figure.suptitle("single-stage trap task, same tiny model: async-rl vs TRL GRPOTrainer (one line per seed)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one seed and a shorter time limit")
    parser.add_argument("--seeds", type=int, nargs="*", help="seeds (default: 0 1 2 3 4; --quick: 0)")
    parser.add_argument("--max-wall-s", type=float, help="time limit per run (default 600; --quick 150)")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    max_wall_s = args.max_wall_s or (150.0 if args.quick else 600.0)
    if args.trl_child:
        trl_child(args.seed, args.model_dir, max_wall_s, args.result)
        return 0
    missing = trl_missing()
    if missing:
        print(f"vs_trl: cannot compare: {missing}", file=sys.stderr)
        return 1
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2, 3, 4])
    results = []
    for n, seed in enumerate(seeds):
        model_dir = build_model(seed)
        runners = [("async-rl", run_async_rl), ("TRL", run_trl)]
        for name, runner in runners if n % 2 == 0 else runners[::-1]:  # alternate who goes first
            print(f"seed {seed}: {name} ...", file=sys.stderr, flush=True)
            results.append(runner(seed, model_dir, max_wall_s))
    OUT.mkdir(parents=True, exist_ok=True)

    def median(system: str, key: str) -> float | None:
        values = [r[key] for r in results if r["system"] == system and r[key] is not None]
        reached_all = len(values) == sum(r["system"] == system for r in results)
        return statistics.median(values) if values and reached_all else None

    for r in results:  # the learning phase alone: from the first full window (512 samples scored) to the target
        reached = r["time_to_target_s"] is not None and r["curve"]
        r["window_to_target_s"] = r["time_to_target_s"] - r["curve"][0][1] if reached else None
    summary = {
        "time_to_target_ratio": ratio(median("TRL", "time_to_target_s"), median("async-rl", "time_to_target_s")),
        "window_to_target_ratio": ratio(median("TRL", "window_to_target_s"), median("async-rl", "window_to_target_s")),
        "samples_ratio": ratio(median("TRL", "samples"), median("async-rl", "samples")),
        "time_to_target_s": {s: median(s, "time_to_target_s") for s in ("async-rl", "TRL")},
        "window_to_target_s": {s: median(s, "window_to_target_s") for s in ("async-rl", "TRL")},
        "samples_to_target": {s: median(s, "samples") for s in ("async-rl", "TRL")},
        "seeds": seeds, "target": TARGET, "window": WINDOW,
    }
    (OUT / "results.json").write_text(json.dumps(results, indent=1))
    table(results)
    plot(results, OUT / "vs_trl.png" if args.quick else REPO / "docs" / "img" / "vs_trl.png")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
