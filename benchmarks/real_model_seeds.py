"""real_model.py's comparison: the arms of one seed side by side, each run measured and evaluated held out, the
baseline's learning rate chosen on seed 0, the paired test between arms, and the spread across seeds.

Arms (every other setting is the recipe's and the same for all, the test checks it on the runs' config.yaml):
  immediate+correction   the shipped rule, `algo.immediate_hold` at its default
  outcome-only+step      the baseline, at its learning rate chosen on seed 0 (`learner.lr`)
  immediate-at-once      immediate+correction with `algo.immediate_hold=0`: immediate items trained at once
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from common import RunResult, console, first_at_target, median_or_none, ratio, train
from real_model_parts import PeakPss, held_out, mcnemar, settings_key

SHIPPED = "immediate+correction"
BASELINE = "outcome-only+step"
AT_ONCE = "immediate-at-once"
ARMS = {
    SHIPPED: ["algo.updates=immediate+correction", "algo.credit=outcome+step"],
    BASELINE: ["algo.updates=outcome-only", "algo.credit=outcome+step"],
    AT_ONCE: ["algo.updates=immediate+correction", "algo.credit=outcome+step", "algo.immediate_hold=0"],
}
# What each arm's config may differ by from the shipped arm's of the same seed (beside run.name): nothing else.
ARM_DEFINES = {SHIPPED: set(), BASELINE: {"algo.updates", "learner.lr"}, AT_ONCE: {"algo.immediate_hold"}}
PAIRS = [(SHIPPED, BASELINE), (AT_ONCE, BASELINE), (SHIPPED, AT_ONCE)]
WINDOW = 64  # replay.success_window's default: the training success rate is over the last 64 trajectories


def run_name(arm: str, seed: int, lr: float | None = None) -> str:
    slug = arm.replace("+", "-")
    return f"{slug}-lr{lr:g}-seed{seed}" if lr is not None else f"{slug}-seed{seed}"


def rollout_lines(run: RunResult) -> list[dict[str, Any]]:
    path = run.run_dir / "metrics" / "rollout-0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [line for line in lines if "tokens_per_s" in line]


def measure(run: RunResult, pss_mib: float, warm: dict[str, Any], final: dict[str, Any], target: float,
            delay: float) -> dict[str, Any]:
    """One run's figures: held out, its gain over the warm start, versions, D (the judge's latency x learner
    versions per second: the outcome's delay in versions), the hold's count, memory (peak PSS), the curve."""
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
    d = None if judge_s is None or per_s is None else round(judge_s * per_s, 2)
    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    hit = first_at_target(learner, target, WINDOW)
    return {
        "held_out": final,
        "delta_points": round(100 * (final["success"] - warm["success"]), 1),
        "versions": versions,
        "env_steps": run.summary["env_steps"],
        "trajectories_finished": finished,
        "wall_s": round(run.summary["wall_s"], 1),
        "stop_reason": run.summary["stop_reason"],
        "wall_s_to_train_target": hit and round(hit["wall_s"], 1),
        "s_per_version": round(last["wall_s"] / versions, 1) if versions and last else None,
        "rollout_tokens_per_s": round(sum(m["tokens_per_s"] for m in rollout) / len(rollout), 2) if rollout else None,
        "peak_pss_mib": pss_mib,
        "judge_latency_s": judge_s and round(judge_s, 2),
        "d_versions": d,
        # the judge delay that would have made D 5 at this run's pace (D scales with the delay)
        "judge_delay_s_for_d5": round(5 * delay / d) if d else None,
        "immediate_held_over": last.get("immediate_held_over"),
        "immediate_before_outcome": sum(m.get("immediate_before_outcome", 0) for m in learner),
        "credit_dropped": last.get("credit_dropped"),
        "records_rejected": last.get("rejected"),  # token ids >= the model's vocab (replay.vocab_size) among them
        "ledger_residual_max": max((m["ledger_residual_max"] for m in learner), default=None),
        "tool_calls": sum(line["tool_calls"] for line in rollout),
        "tool_call_errors": sum(line["tool_call_errors"] for line in rollout),
        "rollout_lines": len(rollout),
        "curve": [[round(m["wall_s"], 1), round(m["success_rate"], 4)] for m in learner],
        "model_path": config["model"]["path"],
        "lora_rank": config["learner"]["lora"]["rank"],
        "lr": config["learner"]["lr"],
        "immediate_hold": config["algo"]["immediate_hold"],
        "run_dir": str(run.run_dir),
    }


class SeedPlan:
    """What one seed runs, in order (a wave of --side-by-side runs at a time): the shipped arm and the baseline
    (at its first candidate rate, or the chosen one), then the at-once arm where asked and, on seed 0 before a rate
    is chosen, the baseline at each other candidate. With 2 side by side, seed 0's 4 runs are 2 waves of an
    immediate arm beside a baseline, and a later seed's 2 runs one wave."""

    def __init__(self, seed: int, lr: float, baseline_lrs: list[float], chosen: float | None, at_once: bool) -> None:
        self.seed = seed
        sweep = chosen is None
        first = baseline_lrs[0] if sweep else chosen
        self.runs: list[tuple[str, str, float]] = [
            (run_name(SHIPPED, seed), SHIPPED, lr), (run_name(BASELINE, seed, first if sweep else None), BASELINE,
                                                     first)]
        if at_once:
            self.runs.append((run_name(AT_ONCE, seed), AT_ONCE, lr))
        if sweep:
            self.runs += [(run_name(BASELINE, seed, rate), BASELINE, rate) for rate in baseline_lrs[1:]]


def run_arm(out_dir: Path, name: str, overrides: list[str], timeout_s: float, eval_args: list[str]
            ) -> tuple[RunResult, float, dict[str, Any]]:
    console.print(f"[bold]real_model[/] training {name}")
    memory = PeakPss(name)
    try:
        run = train(out_dir, name, overrides, timeout_s=timeout_s)
    finally:
        pss_mib = memory.done()
    console.print(f"  {name}: {run.summary['stop_reason']} after {run.summary['wall_s']:.0f} s, "
                  f"{run.summary['versions']} version(s); held-out eval")
    final = held_out(out_dir, name, ["--config", str(run.run_dir / "config.yaml")], eval_args, reuse=False)
    return run, pss_mib, final


def run_seed(out_dir: Path, plan: SeedPlan, training: list[str], timeout_s: float, eval_args: list[str],
             warm: dict[str, Any], target: float, delay: float, side_by_side: int, reuse: bool) -> dict[str, Any]:
    """The seed's runs, `side_by_side` at a time (a wave shares the cores alike), each then evaluated held out; the
    baseline's rate chosen where the plan sweeps it; the paired tests. Each wave is saved as soon as its runs are
    evaluated (done/run-<name>-<key>.json), the seed once all are (done/seed<N>-<key>.json): what --reuse keeps."""
    key = settings_key({"training": training, "eval": eval_args, "runs": plan.runs, "v": 2})
    saved = out_dir / "done" / f"seed{plan.seed}-{key}.json"
    if reuse and saved.exists():
        console.print(f"[bold]real_model[/] seed {plan.seed}: reused from {saved}")
        return json.loads(saved.read_text())
    measured: dict[str, dict[str, Any]] = {}
    for start in range(0, len(plan.runs), side_by_side):
        wave = plan.runs[start:start + side_by_side]
        kept = {name: out_dir / "done" / f"run-{name}-{settings_key({'seed': key, 'wave': wave})}.json"
                for name, _, _ in wave}
        if reuse and all(path.exists() for path in kept.values()):  # a wave finished in an earlier session
            console.print(f"[bold]real_model[/] {', '.join(kept)}: reused")
            measured.update({name: json.loads(path.read_text()) for name, path in kept.items()})
            continue
        with ThreadPoolExecutor(len(wave)) as pool:
            futures = {name: pool.submit(run_arm, out_dir, name, [*training, f"run.seed={plan.seed}",
                                                                  f"learner.lr={lr}", *ARMS[arm]],
                                         timeout_s, eval_args) for name, arm, lr in wave}
            for name, future in futures.items():
                run, pss, final = future.result()
                measured[name] = measure(run, pss, warm, final, target, delay)
        for name, path in kept.items():
            path.write_text(json.dumps(measured[name]))
    arms = {arm: measured[name] for name, arm, _ in plan.runs if arm != BASELINE}
    sweep = {f"{lr:g}": measured[name] for name, arm, lr in plan.runs if arm == BASELINE}
    chosen = choose_rate(sweep)
    arms[BASELINE] = sweep[chosen]
    result = {"arms": arms, "baseline_lr": {"chosen": float(chosen), "candidates": {
        lr: m["held_out"]["success"] for lr, m in sweep.items()}}, "paired": paired(arms)}
    if len(sweep) > 1:
        result["baseline_sweep"] = sweep
    saved.write_text(json.dumps(result))
    return result


def choose_rate(sweep: dict[str, dict[str, Any]]) -> str:
    """The baseline's best rate: the highest held-out success on this seed; a tie goes to the first listed (the
    recipe's rate first)."""
    return max(sweep, key=lambda lr: (sweep[lr]["held_out"]["success"], -list(sweep).index(lr)))


def paired(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """McNemar's exact test for each pair of arms on the same held-out episodes (same tasks, same sampling seed)."""
    out = {}
    for a, b in PAIRS:
        if a in arms and b in arms:
            first, second = arms[a]["held_out"], arms[b]["held_out"]
            if first["task_ids"] != second["task_ids"]:
                raise ValueError(f"{a} and {b} were evaluated on different held-out tasks: no paired test")
            out[f"{a} vs {b}"] = mcnemar(first["per_episode"], second["per_episode"])
    return out


def spread(values: list[float | None]) -> dict[str, Any]:
    """Median and min-max over the seeds where the value exists, and how many those are."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "seeds": 0}
    return {"median": round(statistics.median(known), 3), "min": round(min(known), 3), "max": round(max(known), 3),
            "seeds": len(known)}


def gain_ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """a's held-out gain over the warm start / b's: none where b gained nothing (a ratio of a loss means nothing)."""
    return ratio(a["delta_points"], b["delta_points"]) if b["delta_points"] > 0 else None


def across_seeds(seeds: dict[int, dict[str, Any]]) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in ARMS:
        runs = [result["arms"][arm] for result in seeds.values() if arm in result["arms"]]
        if not runs:
            continue
        times = [run["wall_s_to_train_target"] for run in runs]
        arms[arm] = {
            "held_out_success": spread([run["held_out"]["success"] for run in runs]),
            "delta_points": spread([run["delta_points"] for run in runs]),  # the gain over the warm start
            "wall_s_to_train_target_median": median_or_none(times),  # a miss counts as never
            "seeds_reaching_train_target": sum(t is not None for t in times),
            "d_versions": spread([run["d_versions"] for run in runs]),
            "versions": spread([run["versions"] for run in runs]),
        }
    both = [result["arms"] for result in seeds.values()]
    summary: dict[str, Any] = {
        "arms": arms,
        # > 1: immediate+correction gained more over the warm start in the same wall time (none where the
        # baseline gained nothing)
        "held_out_gain_ratio": spread([gain_ratio(r[SHIPPED], r[BASELINE]) for r in both]),
        "held_out_gain_difference_points": spread([r[SHIPPED]["delta_points"] - r[BASELINE]["delta_points"]
                                                   for r in both]),
        # < 1: immediate+correction reached the training target sooner; seeds where either arm missed it are left
        # out and counted in seeds_reaching_train_target
        "train_time_to_target_ratio": spread([ratio(r[SHIPPED]["wall_s_to_train_target"],
                                                    r[BASELINE]["wall_s_to_train_target"]) for r in both]),
    }
    with_at_once = [r for r in both if AT_ONCE in r]
    if with_at_once:
        summary["at_once_gain_ratio"] = spread([gain_ratio(r[AT_ONCE], r[BASELINE]) for r in with_at_once])
        summary["hold_vs_at_once_gain_difference_points"] = spread(
            [r[SHIPPED]["delta_points"] - r[AT_ONCE]["delta_points"] for r in with_at_once])
    return summary
