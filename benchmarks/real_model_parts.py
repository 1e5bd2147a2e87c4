"""real_model.py's steps that are not the comparison itself: import, warm start, held-out eval and its statistics
(Wilson interval, McNemar's paired test), memory (PSS), the plot.

Each step is a real `python -m launch.cli` subprocess (`model import`, `demos`, `sft`, `evaluate`), its stderr in a
log file of the out dir; a failure raises BenchmarkError naming that log.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
from common import REPO, BenchmarkError, console, pinned_env

RECIPE = REPO / "configs" / "smollm2-chain.yaml"  # the README's warm-start recipe: the chain env and its settings
SAMPLE_EVERY_S = 2.0
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def ensure_model(model: Path) -> None:
    if (model / "config.json").exists():
        return
    console.print(f"[bold]real_model[/] importing smollm2-135m-instruct into {model} (bf16)")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "model", "import", "smollm2-135m-instruct",
                           str(model), "--dtype", "bf16"], capture_output=True, text=True, cwd=REPO, timeout=1200)
    if done.returncode != 0:
        raise BenchmarkError(f"model import failed:\n{done.stderr[-2000:]}")


def command(log: Path, args: list[str], timeout_s: float) -> dict[str, Any]:
    """`async-rl ARGS` (as `python -m launch.cli`): its last stdout line, a JSON object; stderr in `log`."""
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "launch.cli", *args], stdout=subprocess.PIPE, stderr=stderr,
                              text=True, env=pinned_env(), cwd=REPO, timeout=timeout_s)
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BenchmarkError(f"async-rl {args[0]}: exit code {done.returncode} (log: {log})\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def settings_key(settings: dict[str, Any]) -> str:
    """A short name for a set of settings: what a cached step under the out dir is matched by (--reuse)."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def warm_start(out_dir: Path, base: Path, settings: dict[str, Any], reuse: bool) -> tuple[Path, dict[str, Any]]:
    """`async-rl demos` then `async-rl sft` from `base` (the README's recipe; `settings`: demos, lora_rank, lr,
    epochs, max_steps) into out_dir/warm-<key>/model; with `reuse`, a finished warm start of the same settings is kept.
    Returns the model directory and what the two commands reported."""
    settings = {**settings, "model": str(base), "recipe": RECIPE.read_text()}
    tuning = f"lora{settings['lora_rank']}" if settings["lora_rank"] else "full"
    warm_dir = out_dir / f"warm-{tuning}-{settings_key(settings)}"
    model, record = warm_dir / "model", warm_dir / "warm.json"
    if reuse and record.exists() and (model / "config.json").exists():
        console.print(f"[bold]real_model[/] warm start reused from {warm_dir}")
        return model, json.loads(record.read_text())
    if warm_dir.exists():
        shutil.rmtree(warm_dir)
    warm_dir.mkdir(parents=True)
    demos_file = warm_dir / "demos.jsonl"
    console.print(f"[bold]real_model[/] warm start: {settings['demos']} demonstrations, then SFT ({tuning}, lr "
                  f"{settings['lr']:g}) into {model}")
    demos = command(warm_dir / "demos.log", ["demos", "--config", str(RECIPE), "--out", str(demos_file),
                                             "--n", str(settings["demos"]), f"model.path={base}"], 1800)
    sft_args = ["sft", "--model", str(base), "--data", str(demos_file), "--out", str(model), "--config", str(RECIPE),
                f"run.dir={warm_dir}", f"learner.lr={settings['lr']}", "--epochs", str(settings["epochs"])]
    if settings["lora_rank"]:
        sft_args += ["--lora-rank", str(settings["lora_rank"])]
    if settings["max_steps"]:
        sft_args += ["--max-steps", str(settings["max_steps"])]
    sft = command(warm_dir / "sft.log", sft_args, 4 * 3600)
    console.print(f"  warm start: {sft['steps']} SFT step(s) on {sft['conversations']} conversations in "
                  f"{sft['wall_s']:.0f} s")
    done = {"settings": {k: v for k, v in settings.items() if k != "recipe"}, "demos": demos, "sft": sft}
    record.write_text(json.dumps(done, indent=2))
    return model, done


def wilson(successes: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate of `successes` in `n` episodes."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def held_out(out_dir: Path, name: str, args: list[str], eval_args: list[str], reuse: bool) -> dict[str, Any]:
    """`async-rl evaluate ARGS EVAL_ARGS` summarized: success with its Wilson interval, the share of episodes with a
    well-formed tool call, calls an episode. Saved as out_dir/evals/NAME-<key>.json; with `reuse` a saved one of
    the same arguments is read back instead (the base and warmed-up models' evals)."""
    saved = out_dir / "evals" / f"{name}-{settings_key({'args': args, 'eval': eval_args})}.json"
    if reuse and saved.exists():
        console.print(f"[bold]real_model[/] {name}: held-out eval reused from {saved}")
        return json.loads(saved.read_text())
    result = command(out_dir / f"{name}.eval.log", ["evaluate", *args, *eval_args, "run.log_level=WARNING"], 4 * 3600)
    episodes = result["eval_tasks"] * int(next(a for a in eval_args if "eval_samples_per_task" in a).split("=")[1])
    successes = round(result["eval_success_rate"] * episodes)
    low, high = wilson(successes, episodes)
    summary = {
        "success": round(result["eval_success_rate"], 4), "successes": successes, "episodes": episodes,
        "ci95": [round(low, 4), round(high, 4)],
        "called_tool": result.get("eval_called_tool"),  # the share of episodes with a well-formed call (chain env)
        "tool_calls_per_episode": result.get("eval_tool_calls"),
        "dead_ends_per_episode": result.get("eval_dead_ends"),
        "chain_reached": result.get("eval_chain_reached"),
        "version": result.get("eval_version"),
        "task_ids": result["eval_task_ids"],  # the episodes a paired test pairs, in order
        "per_episode": result["eval_per_task"],  # each task's success (0 or 1 with one sample a task)
    }
    saved.parent.mkdir(exist_ok=True)
    saved.write_text(json.dumps(summary))
    return summary


def binomial_two_sided(k: int, n: int) -> float:
    """The exact two-sided p-value of k or fewer (or as many more) successes in n fair coin flips."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


def mcnemar(first: list[float], second: list[float]) -> dict[str, Any]:
    """McNemar's exact test of two policies on the same episodes (per-episode successes, 0 or 1): only the
    discordant episodes count, and under no difference each is the first's win with probability 1/2. Episodes
    with several samples (a fraction) are not paired; the test is then None."""
    if len(first) != len(second):
        raise ValueError(f"paired episodes differ in number: {len(first)} vs {len(second)}")
    if any(v not in (0, 1) for v in (*first, *second)):
        return {"only_first": None, "only_second": None, "p": None, "why": "not one sample a task"}
    only_first = sum(a == 1 and b == 0 for a, b in zip(first, second, strict=True))
    only_second = sum(a == 0 and b == 1 for a, b in zip(first, second, strict=True))
    return {"only_first": only_first, "only_second": only_second,
            "p": round(binomial_two_sided(only_first, only_first + only_second), 4)}


class PeakPss:
    """The peak proportional set size of the `async-rl train` child whose command line names `run.name=NAME`,
    summed over its process tree, sampled every SAMPLE_EVERY_S seconds until stopped. PSS, not RSS: a page
    shared by forked processes (the fork server's children share its imported modules) counts once in all, split
    among them, where summed RSS counts it once per process."""

    def __init__(self, name: str) -> None:
        self.tag, self.peak, self.stop = f"run.name={name}", 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def tree_pss(self) -> int:
        for child in psutil.Process().children(recursive=True):
            try:
                if self.tag in child.cmdline() and "train" in child.cmdline():
                    return sum(_pss(p) for p in [child, *child.children(recursive=True)])
            except psutil.Error:  # a process that ended while it was read
                continue
        return 0

    def sample(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            self.peak = max(self.peak, self.tree_pss())

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return round(self.peak / 2**20, 1)


def _pss(process: psutil.Process) -> int:
    try:
        return process.memory_full_info().pss
    except psutil.Error:  # ended while it was read
        return 0


def plot(runs: dict[str, list[dict[str, Any]]], warm: dict[str, Any], target: float | None, title: str,
         path: Path) -> None:
    """Training success (the learner's window) against wall time, one line a run, a colour an arm; each run's final
    held-out success and its 95% interval at its end; the warm start's held-out success as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    ax.axhspan(*warm["ci95"], color="grey", alpha=0.15, label=f"warm start, held out: {warm['success']:.3f}")
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"training target {target:.2f}")
    for colour, (arm, measured) in zip(("tab:blue", "tab:orange", "tab:green"), runs.items(), strict=False):
        for number, run in enumerate(measured):
            minutes = [wall / 60 for wall, _ in run["curve"]]
            ax.plot(minutes, [success for _, success in run["curve"]], color=colour, alpha=0.8, linewidth=1.2,
                    label=f"{arm} (training)" if number == 0 else None)
            final, (low, high) = run["held_out"]["success"], run["held_out"]["ci95"]
            ax.errorbar([run["wall_s"] / 60], [final], yerr=[[final - low], [high - final]], color=colour,
                        marker="o", capsize=3, label=f"{arm}: final, held out" if number == 0 else None)
    ax.set(xlabel="wall time (minutes)", ylabel="success rate", ylim=(-0.02, 1.02), title=title)
    ax.set_xlim(left=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
