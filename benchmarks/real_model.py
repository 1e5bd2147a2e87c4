"""A real pretrained model learns a tool task: SmolLM2-135M-Instruct on the `tasks` env, two update rules side by side.

The model is `--model DIR` (imported first with `async-rl model import smollm2-135m-instruct DIR --dtype bf16` when
DIR has no config.json; the learner and the engine upcast to fp32). The task is fixed here, not tuned to the eval
split: reasoning-gym's `chain_sum` with two terms of 1 digit (configs/smollm2.yaml's task), the `calculator` tool,
an untagged final turn answering its last number, 200 entries split with seed 0 (`TASK` below). Phases:

  1. base eval      `async-rl evaluate` of the untrained model (version 0 = model.path) on the eval split
  2. training       `immediate+correction` and `outcome-only` (both `algo.credit=outcome+step`) as two
                    `async-rl train` runs AT ONCE (two threads; the two cores are shared), each stopped by
                    `run.max_wall_s` = --minutes (and `run.max_versions` in --quick); both full fine-tune, or both
                    LoRA with --lora-rank; the judge sleeps --judge-delay-s, so outcomes arrive late
  3. final eval     `async-rl evaluate --config RUN/config.yaml` of each run's last weights, same tasks, samples
                    and sampling seed as the base eval (the judge's delay set to 0: it changes no verdict)

Per arm: base and final eval success and the delta in points, versions, env steps, seconds per version, rollout
tokens/s (rollout-0 metrics lines), peak RSS of the run's process tree (psutil, every 2 s), the measured judge
latency and D = that latency x learner versions per second (the outcome's delay in versions, as delay.py's
`d_from_updates`), the learner's `correction_bound_needed` and `ledger_residual_max`, and the tool calls and
unparsed calls counted on the rollout lines; `delta_ratio` = delta(immediate+correction) / delta(outcome-only+step).

    python benchmarks/real_model.py --quick    # LoRA rank 8, 1 version of 1 group of 2 per arm, 1 task x 2 samples
    python benchmarks/real_model.py --minutes 60 --judge-delay-s 120    # full fine-tune, 12 tasks x 4 samples
    python benchmarks/real_model.py --minutes 60 --judge-delay-s 120 --lora-rank 8
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 - benchmarks/ is not a package; scripts run as `python benchmarks/NAME.py`
    OUT_DIR,
    REPO,
    BenchmarkError,
    RunResult,
    console,
    emit,
    fmt,
    machine,
    markdown_table,
    pinned_env,
    print_table,
    ratio,
    train,
)

DEFAULT_MODEL = OUT_DIR / "smollm2"
TASK: dict[str, Any] = {
    "dataset": "chain_sum",
    "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "untagged": "last-number",
    "tools": ["calculator"],
    "size": 200,
    "seed": 0,
}
# The real model on a 2-core CPU: short actions, small groups and batches (a learner step on 1-2k tokens: 10-30 s).
SETTINGS = [
    "env.name=tasks", "model.max_seq_len=1024", "rollout.group_size=4", "rollout.max_inflight=8",
    "rollout.max_new_tokens=48", "learner.min_batch_items=8", "learner.batch_tokens=4096",
    "learner.micro_batch_tokens=2048", "run.target_success=null", "run.metrics_every_s=30",
    "algo.max_correction_staleness=256",  # a slow judge must not make the learner drop the outcome's credit
    # as configs/smollm2.yaml: no entropy bonus for a pretrained policy (the tiny model's 0.2 would unlearn language),
    # 2 groups a step, a checkpoint only at the end, 2 weight files kept
    "algo.entropy_coef=0.0", "algo.groups_per_step=2", "learner.checkpoint_every=0", "learner.keep_weights=2",
    "replay.batch_ack_timeout_s=600",  # steps of 60-150 s here: at the default 120 s slow steps' batches were requeued
]
# --quick proves the script end to end, not learning: a version is one group of 2 (a quarter of the learner step's
# tokens), and admission at staleness 0 (`algo.max_staleness=0`) starts no group past the one that version trains, so
# the learner's step does not share the 2 cores with the rollout of groups that the run never trains (two arms side
# by side are four such processes).
QUICK_SETTINGS = ["algo.groups_per_step=1", "rollout.group_size=2", "learner.min_batch_items=2",
                  "rollout.max_inflight=2", "algo.max_staleness=0"]
ARMS = {
    "immediate+correction": ["algo.updates=immediate+correction", "algo.credit=outcome+step"],
    "outcome-only+step": ["algo.updates=outcome-only", "algo.credit=outcome+step"],
}
SAMPLE_EVERY_S = 2.0


def ensure_model(model: Path) -> None:
    if (model / "config.json").exists():
        return
    console.print(f"[bold]real_model[/] importing smollm2-135m-instruct into {model} (bf16)")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "model", "import", "smollm2-135m-instruct",
                           str(model), "--dtype", "bf16"], capture_output=True, text=True, cwd=REPO, timeout=1200)
    if done.returncode != 0:
        raise BenchmarkError(f"model import failed:\n{done.stderr[-2000:]}")


def task_kwargs(judge_delay_s: float) -> str:
    return "env.kwargs=" + json.dumps({**TASK, "judge_delay_s": judge_delay_s})


def evaluate(out_dir: Path, name: str, args: list[str]) -> dict[str, Any]:
    """`async-rl evaluate ARGS` (its JSON line); stderr in out_dir/NAME.eval.log."""
    log = out_dir / f"{name}.eval.log"
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "launch.cli", "evaluate", *args, "run.log_level=WARNING"],
                              stdout=subprocess.PIPE, stderr=stderr, text=True, env=pinned_env(), cwd=REPO,
                              timeout=1800)
    if done.returncode != 0 or not done.stdout.strip():
        raise BenchmarkError(f"{name}: evaluate exit code {done.returncode} (log: {log})")
    return json.loads(done.stdout.strip().splitlines()[-1])


class PeakRss:
    """The peak resident memory of the `async-rl train` child whose command line names `run.name=NAME`, its own
    process tree summed, sampled every SAMPLE_EVERY_S seconds until stopped."""

    def __init__(self, name: str) -> None:
        self.tag, self.peak, self.stop = f"run.name={name}", 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def tree_rss(self) -> int:
        for child in psutil.Process().children(recursive=True):
            try:
                if self.tag in child.cmdline() and "train" in child.cmdline():
                    tree = [child, *child.children(recursive=True)]
                    return sum(p.memory_info().rss for p in tree if p.is_running())
            except psutil.Error:  # a process that ended while it was read
                continue
        return 0

    def sample(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, self.tree_rss())

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return round(self.peak / 2**20, 1)


def run_arm(out_dir: Path, arm: str, overrides: list[str], timeout_s: float, eval_args: list[str]
            ) -> tuple[RunResult, float, dict[str, Any]]:
    name = arm.replace("+", "-")
    console.print(f"[bold]real_model[/] training {arm}")
    memory = PeakRss(name)
    try:
        run = train(out_dir, name, overrides, timeout_s=timeout_s)
    finally:
        peak_mib = memory.done()
    console.print(f"  {arm}: {run.summary['stop_reason']} after {run.summary['wall_s']:.0f} s, "
                  f"{run.summary['versions']} version(s); evaluating")
    final = evaluate(out_dir, name, ["--config", str(run.run_dir / "config.yaml"), *eval_args])
    return run, peak_mib, final


def rollout_lines(run: RunResult) -> list[dict[str, Any]]:
    path = run.run_dir / "metrics" / "rollout-0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [line for line in lines if "tokens_per_s" in line]


def measure(run: RunResult, peak_mib: float, base: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    learner = [line for line in run.lines if "wall_s" in line]
    rollout = rollout_lines(run)
    finished = sum(line["trajectories_finished"] for line in rollout)
    judge_s = ratio(sum(line["judge_latency_s_mean"] * line["trajectories_finished"] for line in rollout), finished)
    versions = run.summary["versions"] or 0
    last = learner[-1] if learner else {}
    if len(learner) >= 2:
        per_s = ratio(learner[-1]["version"] - learner[0]["version"], learner[-1]["wall_s"] - learner[0]["wall_s"])
    else:
        per_s = ratio(versions, last.get("wall_s"))
    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    base_rate, final_rate = base["eval_success_rate"], final["eval_success_rate"]
    return {
        "base_eval_success": base_rate,
        "final_eval_success": final_rate,
        "delta_points": round(100 * (final_rate - base_rate), 1),
        "final_eval_version": final.get("eval_version"),
        "final_eval_tool_calls": final.get("eval_tool_calls"),
        "versions": versions,
        "env_steps": run.summary["env_steps"],
        "trajectories_finished": finished,
        "wall_s": round(run.summary["wall_s"], 1),
        "stop_reason": run.summary["stop_reason"],
        "s_per_version": round(last["wall_s"] / versions, 1) if versions and last else None,
        "learner_step_s_mean": round(sum(m["step_s"] for m in learner) / len(learner), 1) if learner else None,
        "rollout_tokens_per_s": round(sum(m["tokens_per_s"] for m in rollout) / len(rollout), 2) if rollout else None,
        "peak_rss_mib": peak_mib,
        "judge_latency_s": judge_s and round(judge_s, 2),
        "d_versions": None if judge_s is None or per_s is None else round(judge_s * per_s, 2),
        "correction_bound_needed_max": max((m.get("correction_bound_needed", 0) for m in learner), default=None),
        "staleness_max_correction": max((m.get("staleness_max_correction", 0) for m in learner), default=None),
        "credit_dropped": last.get("credit_dropped"),
        "records_rejected": last.get("rejected"),  # token ids >= the model's vocab (replay.vocab_size) among them
        "immediate_before_outcome": sum(m.get("immediate_before_outcome", 0) for m in learner),
        "ledger_residual_max": max((m["ledger_residual_max"] for m in learner), default=None),
        "tool_calls": sum(line["tool_calls"] for line in rollout),
        "tool_call_errors": sum(line["tool_call_errors"] for line in rollout),
        "rollout_lines": len(rollout),
        "rollout_lines_with_tool_counts": sum("tool_calls" in m and "tool_call_errors" in m for m in rollout),
        "model_path": config["model"]["path"],
        "lora_rank": config["learner"]["lora"]["rank"],
        "lr": config["learner"]["lr"],
        "run_dir": str(run.run_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the suite's form: LoRA rank 8, 1 version of 1 group of 2 per arm, 1 eval task x 2 "
                             "samples")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="model directory (default benchmarks/out/smollm2; imported when it has no config.json)")
    parser.add_argument("--minutes", type=float, default=None, help="run.max_wall_s of each arm (default 60, quick 4)")
    parser.add_argument("--judge-delay-s", type=float, default=None,
                        help="env.kwargs.judge_delay_s while training (default 120, quick 2)")
    parser.add_argument("--lora-rank", type=int, default=None, help="learner.lora.rank (default 0: full fine-tune; "
                                                                     "quick 8)")
    parser.add_argument("--lr", type=float, default=None, help="learner.lr (default 1e-5 full, 2e-4 LoRA)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="run.eval_max_tasks (default 12, quick 1)")
    parser.add_argument("--eval-samples", type=int, default=None, help="samples per eval task (default 4, quick 2)")
    parser.add_argument("--max-versions", type=int, default=None, help="run.max_versions (default none, quick 1)")
    args = parser.parse_args()
    quick = args.quick
    minutes = args.minutes if args.minutes is not None else (4.0 if quick else 60.0)
    delay = args.judge_delay_s if args.judge_delay_s is not None else (2.0 if quick else 120.0)
    rank = args.lora_rank if args.lora_rank is not None else (8 if quick else 0)
    lr = args.lr if args.lr is not None else (2e-4 if rank else 1e-5)
    eval_tasks = args.eval_tasks or (1 if quick else 12)
    eval_samples = args.eval_samples or (2 if quick else 4)
    max_versions = args.max_versions or (1 if quick else None)
    model = args.model.resolve()
    out_dir = OUT_DIR / ("real_model-quick" if quick else "real_model")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    started = time.monotonic()

    ensure_model(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    common = [*SETTINGS, *(QUICK_SETTINGS if quick else []), f"model.path={model}", f"replay.vocab_size={vocab}"]
    eval_args = [f"run.eval_samples_per_task={eval_samples}", f"run.eval_max_tasks={eval_tasks}",
                 "env.kwargs.judge_delay_s=0"]
    console.print(f"[bold]real_model[/] base eval: {eval_tasks} tasks x {eval_samples} samples of {model}")
    base_dir = out_dir / "base"
    if base_dir.exists():
        shutil.rmtree(base_dir)
    base = evaluate(out_dir, "base", [*common, task_kwargs(0.0), f"run.dir={out_dir}", "run.name=base",
                                      *eval_args])
    console.print(f"  base eval success {base['eval_success_rate']:.3f}")

    training = [*common, task_kwargs(delay), f"run.max_wall_s={minutes * 60}", f"learner.lora.rank={rank}",
                f"learner.lr={lr}", *([f"run.max_versions={max_versions}"] if max_versions else [])]
    timeout_s = minutes * 60 + 900  # startup, the last step, shutdown
    with ThreadPoolExecutor(len(ARMS)) as pool:
        futures = {arm: pool.submit(run_arm, out_dir, arm, [*training, *overrides], timeout_s, eval_args)
                   for arm, overrides in ARMS.items()}
        done = {arm: future.result() for arm, future in futures.items()}
    arms = {arm: measure(run, peak, base, final) for arm, (run, peak, final) in done.items()}

    imm, out = arms["immediate+correction"], arms["outcome-only+step"]
    result = {
        "arms": arms,
        "delta_ratio": ratio(imm["delta_points"], out["delta_points"]),
        "base_eval": {k: v for k, v in base.items() if k != "eval_per_task"},
        "task": TASK,
        "judge_delay_s": delay,
        "minutes": minutes,
        "lora_rank": rank,
        "lr": lr,
        "max_versions": max_versions,
        "eval_tasks": eval_tasks,
        "eval_samples_per_task": eval_samples,
        "model": str(model),
        "vocab_size": vocab,
        "quick": quick,
        "total_s": round(time.monotonic() - started, 1),
        "machine": info,
    }
    columns = ["arm", "base eval", "final eval", "delta (pts)", "versions", "env steps", "s/version",
               "rollout tok/s", "peak RSS MiB", "judge s", "D (versions)", "tool calls / errors", "ledger max"]
    rows = [[arm, f"{m['base_eval_success']:.3f}", f"{m['final_eval_success']:.3f}", f"{m['delta_points']:+.1f}",
             str(m["versions"]), f"{m['env_steps']:,}", fmt(m["s_per_version"], ".1f", "n/a"),
             fmt(m["rollout_tokens_per_s"], ".1f", "n/a"), f"{m['peak_rss_mib']:,.0f}",
             fmt(m["judge_latency_s"], ".1f", "n/a"), fmt(m["d_versions"], ".2f", "n/a"),
             f"{m['tool_calls']} / {m['tool_call_errors']}", fmt(m["ledger_residual_max"], ".1e", "n/a")]
            for arm, m in arms.items()]
    tuning = f"LoRA rank {rank}" if rank else "full fine-tune"
    caption = (f"SmolLM2-135M-Instruct, {tuning}, lr {lr:g}, {minutes:g} min per arm side by side, judge delay "
               f"{delay:g} s; eval {eval_tasks} tasks x {eval_samples} samples; delta ratio (immediate+correction / "
               f"outcome-only+step) = {fmt(result['delta_ratio'], '.2f', 'n/a')}; total {result['total_s']:.0f} s")
    print_table("real model: eval success before and after training", columns, rows, caption)
    command = "python benchmarks/real_model.py " + " ".join(sys.argv[1:])
    (out_dir / "table.md").write_text(markdown_table(columns, rows, command.strip()))
    (out_dir / "result.json").write_text(json.dumps(result, indent=2))
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
