"""The benchmark scripts' --quick forms run to the end and print their headline JSON line (numbers go in the docs)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from async_rl.config_load import load_config

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, timeout_s: float, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ablation_quick():
    """Slow: one real `async-rl train` per variant the quick form runs (the three checked here; 3k env steps each,
    most of each run's ~25 CPU-s its processes' start-up), one after another."""
    result = run_benchmark("ablation.py", timeout_s=420)
    variants = {"outcome-only", "immediate-only", "immediate+correction"}
    assert variants <= result["steps_to_target"].keys()
    assert variants <= result["final_success"].keys()
    assert variants <= result["wall_s_to_target"].keys()
    assert "steps_ratio" in result
    # every run spent the quick budget, and the variants that train on stage rewards trained on it
    assert all(reasons == ["max_env_steps"] for reasons in result["stop_reasons"].values()), result["stop_reasons"]
    assert result["versions"]["immediate-only"][0] >= 1 and result["versions"]["immediate+correction"][0] >= 1


def test_ablation_names_an_unknown_variant():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ablation.py"), "--variants",
                           "immediate+correction,imm+corr-typo"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert "--variants: unknown ['imm+corr-typo']" in done.stderr and "imm+corr-no-entropy" in done.stderr


@pytest.mark.slow
def test_async_vs_sync_quick():
    """Slow: two real `async-rl train` runs (lock-step, then async), each to its 30 s cap."""
    result = run_benchmark("async_vs_sync.py", timeout_s=300)
    assert {"throughput_ratio", "time_to_target_ratio", "learner_busy"} <= result.keys()
    assert result["learner_busy"].keys() == {"sync", "async"}
    sync = result["runs"]["sync"][0]
    assert sync["sync_rounds"] >= 1 and sync["leases_denied"] > 0  # a real lock-step run: rounds, and waits


@pytest.mark.slow
def test_trap_dynamics_quick():
    """Slow: 40 real learner steps on the trap env, probed every 10."""
    result = run_benchmark("trap_dynamics.py", timeout_s=300)
    assert result["steps"] == 40 and result["hit_step"] is None  # 40 steps are far too few to reach 0.8
    assert result["stage_reward_last"] > result["stage_reward_first"]  # but the stage rewards are being learned
    probes = [json.loads(line) for line in Path(result["probe"]).read_text().splitlines()]
    assert [p["step"] for p in probes] == [0, 10, 20, 30]
    assert len(probes[0]["p"]) == 16 and all(len(stages) == 4 for stages in probes[0]["p"])  # default env
    assert sum(p_trap is not None for stages in probes[0]["p"] for _, p_trap in stages) == 16 * 2  # 2 traps/task


@pytest.mark.slow
def test_slow_judge_quick():
    """Slow: two real `async-rl train` runs (3k env steps each) whose outcomes each wait for a 2 s judge."""
    result = run_benchmark("slow_judge.py", timeout_s=400)
    assert result["outcome_delay_s"] == 2.0 and result["target"] is None
    assert all(versions[0] >= 1 for versions in result["versions"].values())  # both arms trained within the budget
    assert set(result["time_to_target_s"]) == {"immediate+correction", "outcome-only+step"}
    # With a 2 s judge, immediate items are trained before their trajectory's outcome is known; without them, none.
    assert result["immediate_before_outcome"]["immediate+correction"][0] > 0
    assert result["immediate_before_outcome"]["outcome-only+step"] == [0]


def benchmark_module(name: str):
    """benchmarks/NAME.py as a module (a script, not a package member; its siblings importable)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


# 95% Wilson intervals worked by hand (z = 1.959964, z^2 = 3.841459): centre (p + z^2/2n) / (1 + z^2/n), half-width
# z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n). 1 of 2: centre 0.5, half 1.184263 / 2.920730 = 0.405467. 0 of 2: centre
# = half = 0.960365 / 2.920730 = 0.328810. 34 of 200: centre 0.179604 / 1.019207 = 0.176219, half 0.052938 /
# 1.019207 = 0.051940.
WILSON_BY_HAND = {(0, 2): (0.0, 0.6576), (1, 2): (0.0945, 0.9055), (2, 2): (0.3424, 1.0), (34, 200): (0.1243, 0.2282)}


def test_real_model_wilson_interval_is_the_hand_computed_one():
    parts = benchmark_module("real_model_parts")
    for (successes, n), expected in WILSON_BY_HAND.items():
        assert tuple(round(v, 4) for v in parts.wilson(successes, n)) == expected


def test_real_model_mcnemar_counts_the_discordant_episodes_and_takes_the_exact_binomial_p():
    parts = benchmark_module("real_model_parts")
    first = [1] * 8 + [0] * 2 + [1] * 5 + [0] * 5  # 8 won by the first alone, 2 by the second alone, 10 alike
    second = [0] * 8 + [1] * 2 + [1] * 5 + [0] * 5
    # two-sided: 2 x P(X <= 2), X ~ Binomial(10, 1/2) = 2 (1 + 10 + 45) / 1024
    assert parts.mcnemar(first, second) == {"only_first": 8, "only_second": 2, "p": round(112 / 1024, 4)}
    assert parts.mcnemar(second, first)["p"] == round(112 / 1024, 4)
    assert parts.mcnemar([1, 0], [1, 0]) == {"only_first": 0, "only_second": 0, "p": 1.0}
    assert parts.mcnemar([0.5], [1])["p"] is None  # several samples a task: not paired episodes


def test_real_model_seed_0_sweeps_the_baselines_rate_in_waves_of_an_immediate_arm_beside_a_baseline():
    seeds = benchmark_module("real_model_seeds")
    first = seeds.SeedPlan(0, 1e-5, [1e-5, 3e-5], None, at_once=True)
    assert [(arm, lr) for _, arm, lr in first.runs] == [
        (seeds.SHIPPED, 1e-5), (seeds.BASELINE, 1e-5), (seeds.AT_ONCE, 1e-5), (seeds.BASELINE, 3e-5)]
    later = seeds.SeedPlan(1, 1e-5, [1e-5, 3e-5], 3e-5, at_once=False)
    assert [(name, arm, lr) for name, arm, lr in later.runs] == [
        ("immediate-correction-seed1", seeds.SHIPPED, 1e-5), ("outcome-only-step-seed1", seeds.BASELINE, 3e-5)]
    held = {"0.001": {"held_out": {"success": 0.2}}, "0.003": {"held_out": {"success": 0.2}},
            "0.01": {"held_out": {"success": 0.1}}}
    assert seeds.choose_rate(held) == "0.001"  # a tie goes to the first listed
    held["0.003"]["held_out"]["success"] = 0.25
    assert seeds.choose_rate(held) == "0.003"


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "kwargs":
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def run_config(run_dir: str) -> dict:
    """A run's config.yaml, flat, its own directory's path (in its `auto` endpoints) written as RUN_DIR."""
    text = (Path(run_dir) / "config.yaml").read_text().replace(str(Path(run_dir).resolve()), "RUN_DIR")
    return _flat(yaml.safe_load(text.replace(str(run_dir), "RUN_DIR")))


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-chain")
def test_real_model_quick(smollm2, chain_warm_start):
    """SmolLM2-135M-Instruct through the whole claim's pipeline on the chain recipe, from the README's warm start
    (the `chain_warm_start` fixture: 100 demonstrations, 2 SFT steps, shared with the recipe's test; the script's
    own warm start runs the same two commands): held-out evals of the base and warmed-up models, then seed 0's four
    runs, two side by side (the shipped immediate+correction beside the baseline at its first rate, then
    immediate-at-once beside the baseline at its second), 1 version of one group of 2 each, each evaluated held out
    on the same 2 episodes; the baseline's rate chosen on them; McNemar between the arms. Each check can fail: the
    arms' configs differ only by what the arm is, the episodes are the same, the model called its tool, the
    intervals are the ones the counts give. Slow: a 135M-parameter model on the CPU (a learner step 10-30 s here,
    an eval's episodes ~15 s) and several processes that each load it."""
    seeds = benchmark_module("real_model_seeds")
    warm_model = chain_warm_start / "models" / "smollm2-chain"
    result = run_benchmark("real_model.py", 2400, "--model", str(smollm2), "--warm-model", str(warm_model))
    assert result["vocab_size"] == 49152 and result["lora_rank"] == 8
    assert result["recipe"] == "configs/smollm2-chain.yaml"
    assert result["warm_start"] == {"given": str(warm_model.resolve())}
    task_ids = result["warm"]["task_ids"]
    assert len(task_ids) == 2 and result["base"]["task_ids"] == task_ids
    helds = [result["base"], result["warm"]]
    for model in ("base", "warm"):
        assert result[model]["episodes"] == 2 and result[model]["version"] == 0
    seed = result["seeds"]["0"]
    arms = seed["arms"]
    assert list(result["seeds"]) == ["0"] and set(arms) == set(seeds.ARMS)
    # the baseline ran at both candidate rates; the chosen one is the best held out (the first on a tie)
    sweep = seed["baseline_sweep"]
    assert set(sweep) == {"0.0001", "0.0003"} and result["baseline_lrs"] == [1e-4, 3e-4]
    best = max(m["held_out"]["success"] for m in sweep.values())
    chosen = next(lr for lr, m in sweep.items() if m["held_out"]["success"] == best)
    assert seed["baseline_lr"]["chosen"] == result["baseline_lr_chosen"] == float(chosen)
    assert arms[seeds.BASELINE] == sweep[chosen]
    shipped = run_config(arms[seeds.SHIPPED]["run_dir"])
    assert shipped["algo.updates"] == "immediate+correction"
    assert shipped["algo.immediate_hold"] == load_config().algo.immediate_hold  # the shipped hold, not set
    runs = {**{f"{arm}": m for arm, m in arms.items()}, **{f"baseline lr {lr}": m for lr, m in sweep.items()}}
    for name, arm in runs.items():
        config = run_config(arm["run_dir"])
        differ = {key for key in shipped.keys() | config.keys() if shipped.get(key) != config.get(key)}
        defines = seeds.ARM_DEFINES[seeds.BASELINE if name.startswith("baseline") else name]
        assert differ - {"run.name"} <= defines, (name, differ)
        assert arm["versions"] >= 1 and arm["env_steps"] > 0 and arm["stop_reason"] == "max_versions"
        assert arm["held_out"]["version"] >= 1 and arm["held_out"]["episodes"] == 2  # the trained weights, held out
        assert arm["held_out"]["task_ids"] == task_ids  # the same held-out episodes as the warm start's
        helds.append(arm["held_out"])
        assert arm["delta_points"] == round(100 * (arm["held_out"]["success"] - result["warm"]["success"]), 1)
        assert arm["rollout_lines"] >= 1 and arm["tool_calls"] > 0  # the warmed-up model called its tool
        assert arm["ledger_residual_max"] < 1e-6 and len(arm["curve"]) >= 1
        # RL started from the warm start's model, and no record carried a token id outside SmolLM2's 49,152-token
        # vocabulary (replay.vocab_size)
        assert arm["model_path"] == str(warm_model.resolve()) and arm["records_rejected"] == 0
        assert arm["peak_pss_mib"] > 0 and arm["rollout_tokens_per_s"] > 0
        if name.startswith("baseline"):  # it trained on outcomes, so one was judged: D is measured
            assert arm["d_versions"] is not None and arm["judge_latency_s"] > 1.9
    assert arms[seeds.AT_ONCE]["immediate_hold"] == 0 and arms[seeds.SHIPPED]["immediate_hold"] > 0
    assert arms[seeds.SHIPPED]["lr"] == arms[seeds.AT_ONCE]["lr"] == 1e-4
    for held in helds:  # each interval is the one its counts give (the table above, worked by hand)
        assert held["successes"] == round(held["success"] * held["episodes"]) == sum(held["per_episode"])
        assert tuple(held["ci95"]) == WILSON_BY_HAND[(held["successes"], held["episodes"])]
    for pair, test in seed["paired"].items():
        first, second = (arms[name]["held_out"]["per_episode"] for name in pair.split(" vs "))
        assert test["only_first"] == sum(a > b for a, b in zip(first, second, strict=True)), pair
        assert test["only_second"] == sum(a < b for a, b in zip(first, second, strict=True)), pair
    assert set(seed["paired"]) == {f"{a} vs {b}" for a, b in seeds.PAIRS}
    assert {"held_out_gain_ratio", "train_time_to_target_ratio", "at_once_gain_ratio"} <= result.keys()
    assert result["arms"][seeds.SHIPPED]["held_out_success"]["seeds"] == 1
    assert (REPO / "benchmarks" / "out" / "real_model-quick" / "real_model.png").stat().st_size > 0


@pytest.mark.slow
def test_inflight_quick():
    """Slow: two 4 s rounds of real rollout (16, then 64 trajectories in flight)."""
    result = run_benchmark("inflight.py", timeout_s=120)
    assert set(result["trajectories_per_s"]) == {"16", "64"}
    # 50 ms tools: four groups in flight finish more trajectories per second than one (measured ~4x; a loose bound).
    assert result["speedup_vs_16"]["64"] > 1.5


def test_attention_quick():
    """Packed attention's benchmark: each learner.attention choice that trains here (dense and varlen on CPU) runs
    forward + backward on packed rows of both length mixes, its loss checked against dense's, tokens/s and the
    speed-up over dense reported side by side."""
    result = run_benchmark("attention.py", timeout_s=300)
    assert {"dense", "varlen"} <= set(result["implementations"])
    for mix in ("short", "agent"):
        assert result["speedup"][mix]["dense"] == 1.0
        assert all(result["tokens_per_s"][mix][name] > 0 for name in result["implementations"])
        assert result["speedup"][mix]["varlen"] > 0
    assert result["sequences_per_row"]["short"] > result["sequences_per_row"]["agent"] >= 1


def test_trained_logits_quick():
    """The learner's log-probs at the trained positions only against the full logits: both paths' loss and
    gradients checked equal, then timed side by side; the trained-only path holds the smaller logits."""
    result = run_benchmark("trained_logits.py", timeout_s=120)
    assert result["model"] == "tiny" and 0 < result["trained_tokens"] < result["row_tokens"]
    assert result["logits_mib"]["trained positions"] < result["logits_mib"]["full logits"]
    assert result["speedup"] > 0 and all(s > 0 for s in result["seconds"].values())


@pytest.mark.slow
def test_hunt_quick():
    """Slow: a real `async-rl train env.name=hunt` run, then two `async-rl evaluate` runs (seeing and blind)."""
    result = run_benchmark("hunt.py", timeout_s=400)
    (run,) = result["runs"]
    assert run["versions"] == 5 and not run["reached"]  # 5 versions: the shape of the output, no learning
    assert 0.0 <= run["eval_blind"] <= 1.0 and run["eval_turns"] >= 1.0


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.xdist_group("sglang")  # on the worker that holds the SGLang tests' pool (tests/conftest.py)
def test_sglang_interrupt_quick(servers):
    """Slow: four 5 s rows of generation under aborting updates, on a real SGLang server: the pool's first and its
    tiny model (a start of its own, as the script does without --url, costs 30-45 s more of these 2 cores; the pool
    is started the same way, by scripts/start_sglang_server.py)."""
    result = run_benchmark("sglang_interrupt.py", 400, "--url", servers.urls[0], "--model-dir", str(servers.model_dir))
    assert set(result["variants"]) == {"partial@1s", "discard@1s", "partial@3s", "discard@3s"}
    for every in ("1s", "3s"):
        partial, discard = result["variants"][f"partial@{every}"], result["variants"][f"discard@{every}"]
        assert partial["updates"] > 0 and discard["updates"] > 0
        assert partial["wasted_tokens"] == 0 and discard["kept_tokens"] == 0  # partial keeps, discard throws away
        assert partial["actions"] > 0


@pytest.mark.slow
def test_delay_quick():
    """Slow: two calibration runs side by side, the baseline's max_staleness sweep (4 and 8, one seed each, side by
    side), then the two arms side by side: six real `async-rl train` runs."""
    result = run_benchmark("delay.py", 420, "--baseline-staleness", "4,8")
    calibration = result["calibration"]["2"]
    assert calibration["trajectories_per_s"] > 0 and calibration["trajectories_per_update"] > 0
    runs = result["runs"].values()
    assert {run["arm"] for run in runs} == {"outcome-only+step", "immediate+correction"}
    assert all(run["delay_s"] > 0 and run["d_measured"] is not None for run in runs)  # D is measured, not assumed
    assert all(run["max_correction_staleness"] == "auto" for run in runs)  # the config's bound unless asked otherwise
    # auto's floor, or what the judge needed, once an outcome was in (the cap before it says nothing of the judge)
    assert all(16 <= run["bound_used_max"] < 1024 for run in runs)
    assert result["credit_dropped_total"] == 0  # the guard at the default bound
    assert "traps2-D5" in result["ratios"]
    # fairness: the latency every run had is stated, the baseline ran at its best of the sweep, and each arm's
    # success at fixed wall times (a quarter of the cap each) is there, for a miss to show as a curve
    assert result["step_latency_s"] == 0.01 and all(run["step_latency_s"] == 0.01 for run in runs)
    sweep = result["baseline_staleness"]["traps2-D5"]
    assert sweep["swept"] == [4, 8] and sweep["chosen"] in (4, 8) and set(sweep["per_value"]) == {"4", "8"}
    assert sorted(run["max_staleness"] for run in sweep["runs"].values()) == [4, 8]
    best = result["best"]["traps2-D5"]
    assert best["outcome-only+step"]["max_staleness"] == [sweep["chosen"]]
    assert best["immediate+correction"]["max_staleness"] == [9]  # ceil(D) + 4: the sweep is the baseline's only
    assert result["wall_marks_s"] == [30.0, 60.0, 90.0, 120.0]
    for arm in best.values():
        assert list(arm["success_at_wall"]) == ["30", "60", "90", "120"]
        assert all(0 <= s["min"] <= s["median"] <= s["max"] <= 1 for s in arm["success_at_wall"].values())


BOTH_ARMS = "outcome-only+step,immediate+correction"


def delay_module():
    """benchmarks/delay.py as a module (it is a script, not a package member): its arms and helpers."""
    spec = importlib.util.spec_from_file_location("delay", REPO / "benchmarks" / "delay.py")
    delay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(delay)
    return delay


def test_delay_reports_the_bound_used_once_an_outcome_was_in():
    """`auto` is its cap until the first group's outcomes are in (replay/guard.py); the table's "bound used" is the
    largest bound after that, and the line where the first trajectory finished may still carry the cap."""
    lines = [{"trajectories_finished": 0, "correction_bound": 1024}, {"trajectories_finished": 48,
             "correction_bound": 1024}, {"trajectories_finished": 96, "correction_bound": 60},
             {"trajectories_finished": 200, "correction_bound": 44}]
    assert delay_module().bound_used(lines) == 60
    assert delay_module().bound_used(lines[:2]) is None  # no outcome past the first: nothing to report


def kept_delay(tmp_path: Path, *args: str) -> dict:
    """`delay.py ARGS --out tmp_path --reuse` on the runs a test kept in tmp_path/done: its result (no training)."""
    finished = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "delay.py"), *args, "--out", str(tmp_path), "--reuse"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


def test_delay_reuse_tabulates_kept_runs_without_training(tmp_path):
    """`--reuse` keeps the runs an interrupted sweep saved (here: made up, one per arm) and starts no training run:
    the calibration and both runs come from `done/`, the best-vs-best ratios from their figures."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-traps0.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    kept = {"outcome-only+step": (200_000, 400.0, 100_000, 150.0),
            "immediate+correction": (50_000, 200.0, 60_000, 160.0)}
    for arm, (steps, wall, half_steps, half_wall) in kept.items():
        key = f"traps0-D10-{arm}-lr0.0005-seed0"
        (done / f"{key}.json").write_text(json.dumps({
            "traps": 0, "d": 10.0, "arm": arm, "lr": 0.0005, "seed": 0, "delay_s": 5.0, "per_update": 50.0,
            "max_staleness": 14, "max_correction_staleness": 26, "env_steps_to_target": steps,
            "wall_s_to_target": wall, "env_steps_to_half": half_steps, "wall_s_to_half": half_wall,
            "d_measured": 9.0, "trajectories_per_s": 90.0, "credit_dropped": 0, "wall_s": wall,
            "guard_held_s": 0.0 if arm == "outcome-only+step" else 0.3 * wall,  # over a quarter: named below
            "versions": 100, "final_success_long": 0.8, "stop_reason": "target_success"}))
    result = kept_delay(tmp_path, "--d", "10", "--traps", "0", "--arms", BOTH_ARMS, "--lrs", "5e-4", "--seeds", "1",
                        "--max-correction-staleness", "auto", "--entropy-per", "credit", "--entropy-coef", "0.4")
    assert result["learner"] == ["algo.aggregation=token-sum", "algo.entropy_per=credit", "algo.entropy_coef=0.4"]
    assert result["ratios"]["traps0-D10"] == {"env_steps": 0.25, "wall_s": 0.5, "env_steps_half": 0.6,
                                               "wall_s_half": 160.0 / 150.0, "env_steps_at_most": None,
                                               "wall_s_at_most": None, "env_steps_at_least": None,
                                               "wall_s_at_least": None}  # both reached: no bounds
    assert not any(path.is_dir() and path.name != "done" for path in tmp_path.iterdir())  # nothing was trained
    table = (tmp_path / "table.md").read_text()
    assert "--reuse" in table  # the table names the command that made it
    # the run whose guard held it over a quarter of its wall time is named: the bound set its pace, not the rule
    assert result["guard_bound_warning"] == ["traps0-D10-immediate+correction-lr0.0005-seed0"]
    assert "the correction bound, not the rule, set their pace" in table


def test_delay_baseline_runs_at_its_best_max_staleness_of_the_sweep(tmp_path):
    """`--baseline-staleness 4,16,32` (the default of --shipped is 4,8,16,32) runs outcome-only+step's short sweep
    first (here kept in done/) and its arm at the best: the fewest median wall s to 0.8, else the highest success
    at the sweep's cap. The result records the sweep and each arm's success at fixed wall times; the table states
    the value chosen and the step latency."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-traps2.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    common = {"traps": 2, "d": 10.0, "lr": 0.0005, "delay_s": 5.0, "per_update": 50.0, "d_measured": 9.0,
              "max_correction_staleness": "auto", "credit_dropped": 0, "guard_held_s": 0.0, "step_latency_s": 0.01,
              "learner": ["algo.aggregation=token-sum", "algo.entropy_per=step"]}
    # (value, seed) -> (wall s to 0.8 or None, success at the sweep's cap): 16's median is 120 s, 32's missed
    sweep = {(4, 0): (None, 0.5), (4, 1): (None, 0.6), (16, 0): (100.0, 0.8), (16, 1): (140.0, 0.8),
             (32, 0): (90.0, 0.8), (32, 1): (None, 0.7)}
    for (value, seed), (wall, success) in sweep.items():
        (done / f"sweep-traps2-D10-ms{value}-seed{seed}.json").write_text(json.dumps({
            **common, "arm": "outcome-only+step", "seed": seed, "max_staleness": value, "wall_s_to_target": wall,
            "env_steps_to_target": wall and wall * 100, "final_success_long": success}))
    curves = {"outcome-only+step": [{"150": 0.3, "300": 0.5}, {"150": 0.4, "300": 0.7}],
              "immediate+correction": [{"150": 0.6, "300": 0.8}, {"150": 0.5, "300": 0.8}]}
    for arm, per_seed in curves.items():
        for seed, curve in enumerate(per_seed):
            reached = curve["300"] >= 0.8
            (done / f"traps2-D10-{arm}-lr0.0005-seed{seed}.json").write_text(json.dumps({
                **common, "arm": arm, "seed": seed, "max_staleness": 16 if arm == "outcome-only+step" else 14,
                "env_steps_to_target": 50_000 if reached else None, "wall_s_to_target": 280.0 if reached else None,
                "env_steps_end": 60_000, "wall_s": 300.0, "final_success_long": curve["300"],
                "success_at_wall": curve}))
    result = kept_delay(tmp_path, "--d", "10", "--traps", "2", "--arms", BOTH_ARMS, "--lrs", "5e-4", "--seeds", "2",
                        "--max-wall-s", "300", "--baseline-staleness", "4,16,32", "--fit-d", "0")
    chosen = result["baseline_staleness"]["traps2-D10"]
    assert chosen["chosen"] == 16 and chosen["per_value"]["32"]["wall_s"] is None  # 32's median missed
    assert chosen["per_value"]["4"]["final_success"] == 0.55 and chosen["seeds"] == 2 and chosen["max_wall_s"] == 150
    assert result["step_latency_s"] == 0.01
    best = result["best"]["traps2-D10"]
    assert best["outcome-only+step"]["max_staleness"] == [16]
    assert best["outcome-only+step"]["success_at_wall"]["150"] == {"median": 0.35, "min": 0.3, "max": 0.4}
    assert best["immediate+correction"]["success_at_wall"]["300"] == {"median": 0.8, "min": 0.8, "max": 0.8}
    table = (tmp_path / "table.md").read_text()
    assert "outcome-only+step at max_staleness 16" in table and "0.01 s simulated tool latency" in table
    # read at a quarter of the cap each (75, 150, 225, 300 s): these made-up runs have the second and the last
    assert "| traps2-D10 | outcome-only+step | 16 | 2 | n/a | 0.35 (0.30–0.40) | n/a | 0.60 (0.50–0.70) |" in table


def test_delay_reuse_refuses_a_kept_run_made_at_another_step_latency(tmp_path):
    """The step latency is every run's, stated in the result: a kept run made at 0.01 s (the default; runs kept
    before the option have none and ran at it) is not taken into a `--step-latency-s 0` invocation."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-traps2.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    (done / "traps2-D0-outcome-only+step-lr0.0005-seed0.json").write_text(json.dumps({
        "traps": 2, "d": 0.0, "arm": "outcome-only+step", "lr": 0.0005, "seed": 0, "delay_s": 0.0,
        "per_update": 50.0, "max_staleness": 4, "max_correction_staleness": "auto", "env_steps_to_target": 1000,
        "wall_s_to_target": 1.0, "d_measured": 0.0, "credit_dropped": 0, "guard_held_s": 0.0,
        "learner": ["algo.aggregation=token-sum", "algo.entropy_per=step"]}))
    finished = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "delay.py"), "--d", "0", "--traps", "2", "--arms",
         "outcome-only+step", "--lrs", "5e-4", "--seeds", "1", "--step-latency-s", "0", "--out", str(tmp_path),
         "--reuse"], capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert finished.returncode == 1 and "0.01 s step latency" in finished.stderr
    assert not any(path.is_dir() and path.name != "done" for path in tmp_path.iterdir())  # nothing was trained


def test_delay_reuse_refuses_a_kept_run_made_with_other_learner_flags(tmp_path):
    """The learner flags are not in a run's key, so `--reuse` checks them: a kept run made under --ppo-epochs 2 is
    not taken as a run of the config's learner."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-hunt.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    (done / "hunt-D0-outcome-only+step-lr0.0005-seed0.json").write_text(json.dumps({
        "traps": "hunt", "d": 0.0, "arm": "outcome-only+step", "lr": 0.0005, "seed": 0, "delay_s": 0.0,
        "per_update": 50.0, "max_staleness": 4, "max_correction_staleness": 16, "env_steps_to_target": 1000,
        "wall_s_to_target": 1.0, "d_measured": 0.0, "credit_dropped": 0, "guard_held_s": 0.0,
        "learner": ["algo.aggregation=token-sum", "algo.entropy_per=step", "algo.ppo_epochs=2"]}))
    finished = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "delay.py"), "--env", "hunt", "--d", "0", "--arms",
         "outcome-only+step", "--lrs", "5e-4", "--seeds", "1", "--out", str(tmp_path), "--reuse"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert finished.returncode == 1
    assert "algo.ppo_epochs=2" in finished.stderr and "--reuse would mix them; use another --out" in finished.stderr
    assert not any(path.is_dir() and path.name != "done" for path in tmp_path.iterdir())  # nothing was trained


@pytest.mark.parametrize("missed", ["outcome-only+step", "immediate+correction"])
def test_delay_bounds_the_ratio_where_one_arm_misses_the_target_within_the_cap(tmp_path, missed):
    """Where one arm's median run misses 0.8 within the cap its median is past the cap, so no ratio can be taken;
    counting its misses at their end bounds immediate+correction ÷ outcome-only+step instead: from above where
    outcome-only+step missed, from below where immediate+correction did (the result against us)."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-traps2.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    other = ({"outcome-only+step", "immediate+correction"} - {missed}).pop()
    kept = {(missed, 0): (None, None, 400_000, 1200.0), (missed, 1): (300_000, 900.0, 300_000, 900.0),
            (missed, 2): (None, None, 500_000, 1200.0), (other, 0): (100_000, 300.0, 100_000, 300.0),
            (other, 1): (200_000, 600.0, 200_000, 600.0), (other, 2): (None, None, 450_000, 1200.0)}
    for (arm, seed), (steps, wall, steps_end, wall_end) in kept.items():
        (done / f"traps2-D10-{arm}-lr0.0005-seed{seed}.json").write_text(json.dumps({
            "traps": 2, "d": 10.0, "arm": arm, "lr": 0.0005, "seed": seed, "delay_s": 5.0, "per_update": 50.0,
            "max_staleness": 14, "max_correction_staleness": 26, "env_steps_to_target": steps,
            "wall_s_to_target": wall, "env_steps_end": steps_end, "wall_s": wall_end, "d_measured": 9.0,
            "credit_dropped": 0, "guard_held_s": 0.0}))
    ratios = kept_delay(tmp_path, "--d", "10", "--traps", "2", "--arms", BOTH_ARMS,
                        "--lrs", "5e-4", "--seeds", "3")["ratios"]["traps2-D10"]
    assert ratios["env_steps"] is None and ratios["wall_s"] is None  # one median missed
    # the other arm's median 200,000 / 600 s against at least 400,000 / 1,200 s
    if missed == "outcome-only+step":
        assert (ratios["env_steps_at_most"], ratios["wall_s_at_most"]) == (0.5, 0.5)
        assert ratios["env_steps_at_least"] is None and "at most 0.50, 0.50" in (tmp_path / "table.md").read_text()
    else:
        assert (ratios["env_steps_at_least"], ratios["wall_s_at_least"]) == (2.0, 2.0)
        assert ratios["env_steps_at_most"] is None and "at least 2.00, 2.00" in (tmp_path / "table.md").read_text()


def test_delay_best_lr_where_an_arm_misses_at_every_lr_is_its_lowest_bound(tmp_path):
    """An arm whose median misses 0.8 at every lr is compared at the lr most favourable to it: the lowest bound
    (misses counted at their end), not the first lr of the sweep."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-traps2.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    # (arm, lr) -> per seed (env steps to 0.8 or None, env steps at the end)
    kept = {("immediate+correction", 0.0005): [(None, 900_000), (None, 900_000)],
            ("immediate+correction", 0.00025): [(300_000, 300_000), (None, 600_000)],
            ("outcome-only+step", 0.0005): [(400_000, 400_000), (200_000, 200_000)],
            ("outcome-only+step", 0.00025): [(500_000, 500_000), (None, 900_000)]}
    for (arm, lr), seeds in kept.items():
        for seed, (steps, steps_end) in enumerate(seeds):
            (done / f"traps2-D10-{arm}-lr{lr:g}-seed{seed}.json").write_text(json.dumps({
                "traps": 2, "d": 10.0, "arm": arm, "lr": lr, "seed": seed, "delay_s": 5.0, "per_update": 50.0,
                "max_staleness": 14, "max_correction_staleness": 26, "env_steps_to_target": steps,
                "wall_s_to_target": None if steps is None else steps / 1000, "env_steps_end": steps_end,
                "wall_s": steps_end / 1000, "d_measured": 9.0, "credit_dropped": 0, "guard_held_s": 0.0}))
    result = kept_delay(tmp_path, "--d", "10", "--traps", "2", "--arms", BOTH_ARMS,
                        "--lrs", "5e-4,2.5e-4", "--seeds", "2")
    best = result["best"]["traps2-D10"]
    assert best["outcome-only+step"]["lr"] == 0.0005  # its median reached: 300,000
    assert best["immediate+correction"]["lr"] == 0.00025  # at least 450,000 there, 900,000 at 5e-4
    assert result["ratios"]["traps2-D10"]["env_steps_at_least"] == 1.5


def test_delay_batch_scales_sweep_the_batch_beside_the_lr(tmp_path):
    """`--batch-scales 1,0.25` runs every arm at the config's batch and at a quarter of it (keys `-b0.25`); each
    arm's best is taken over (lr, batch scale), so a baseline that learns faster with more optimizer steps per env
    step is compared at that batch."""
    done = tmp_path / "done"
    done.mkdir()
    (done / "calibrate-hunt.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    kept = {("outcome-only+step", "lr0.0005"): 200_000, ("outcome-only+step", "lr0.0005-b0.25"): 90_000,
            ("immediate+correction", "lr0.0005"): 80_000, ("immediate+correction", "lr0.0005-b0.25"): 120_000}
    for (arm, setting), steps in kept.items():
        (done / f"hunt-D0-{arm}-{setting}-seed0.json").write_text(json.dumps({
            "traps": "hunt", "d": 0.0, "arm": arm, "lr": 0.0005, "batch_scale": 0.25 if "-b" in setting else 1.0,
            "seed": 0, "delay_s": 0.0, "per_update": 50.0, "max_staleness": 4, "max_correction_staleness": 16,
            "env_steps_to_target": steps, "wall_s_to_target": steps / 1000, "d_measured": 0.0, "credit_dropped": 0,
            "guard_held_s": 0.0}))
    result = kept_delay(tmp_path, "--env", "hunt", "--d", "0", "--arms", BOTH_ARMS, "--lrs", "5e-4",
                        "--batch-scales", "1,0.25", "--seeds", "1")
    best = result["best"]["hunt-D0"]
    assert (best["outcome-only+step"]["lr"], best["outcome-only+step"]["batch_scale"]) == (0.0005, 0.25)
    assert best["immediate+correction"]["batch_scale"] == 1.0
    assert set(best["outcome-only+step"]["per_setting"]) == {"lr0.0005", "lr0.0005-b0.25"}
    assert result["ratios"]["hunt-D0"]["env_steps"] == 80_000 / 90_000  # best against best
    assert not any(path.is_dir() and path.name != "done" for path in tmp_path.iterdir())  # nothing was trained


def test_delay_batch_scale_overrides_make_a_valid_config():
    """A batch scale sets the learner's token budget and the items it waits for, both at that fraction (at least 1):
    a config the CLI accepts."""
    delay = delay_module()
    assert delay.batch_overrides(1.0) == []
    assert delay.batch_overrides(0.25) == ["learner.batch_tokens=1024", "learner.min_batch_items=16"]
    assert delay.batch_overrides(0.001) == ["learner.batch_tokens=4", "learner.min_batch_items=1"]
    config = load_config(None, delay.batch_overrides(0.25))
    assert (config.learner.batch_tokens, config.learner.min_batch_items) == (1024, 16)


@pytest.mark.parametrize(("env", "setting", "fit_steps"), [("trap", "traps0", 60_000), ("hunt", "hunt", 200_000)])
def test_delay_fit_reuses_kept_refits_in_order(tmp_path, env, setting, fit_steps):
    """`--fit-d 2` refits the judge delay twice under the judge; with `--reuse` the two kept refits are taken from
    `done/` in order (no training) and the result records each D got and the delay it led to, and the fits' length:
    by default 60,000 env steps, 200,000 on the hunt (a shorter fit sees only its start and sets half the delay)."""
    done = tmp_path / "done"
    done.mkdir()
    (done / f"calibrate-{setting}.json").write_text(json.dumps({"per_s": 100.0, "per_update": 50.0}))
    (done / f"fit-{setting}-D10-0.json").write_text(json.dumps({"delay_s": 5.0, "d_got": 5.0, "next_delay_s": 10.0}))
    (done / f"fit-{setting}-D10-1.json").write_text(json.dumps({"delay_s": 10.0, "d_got": 8.0, "next_delay_s": 12.5}))
    for arm in ("outcome-only+step", "immediate+correction"):
        (done / f"{setting}-D10-{arm}-lr0.0005-seed0.json").write_text(json.dumps({
            "traps": 0 if env == "trap" else "hunt", "d": 10.0, "arm": arm, "lr": 0.0005, "seed": 0, "delay_s": 12.5,
            "per_update": 50.0, "max_staleness": 14, "max_correction_staleness": 26, "env_steps_to_target": 1000,
            "wall_s_to_target": 10.0, "d_measured": 10.0, "credit_dropped": 0, "guard_held_s": 0.0}))
    result = kept_delay(tmp_path, "--env", env, "--d", "10", "--traps", "0", "--arms", BOTH_ARMS,
                        "--lrs", "5e-4", "--seeds", "1", "--fit-d", "2")
    assert result["fits"][f"{setting}-D10"] == [{"d_got": 5.0, "next_delay_s": 10.0},
                                                {"d_got": 8.0, "next_delay_s": 12.5}]
    assert result["fit_steps"] == fit_steps
    assert not any(path.is_dir() and path.name != "done" for path in tmp_path.iterdir())  # nothing was trained


@pytest.mark.parametrize("flag", [("--fit-d", "-1"), ("--entropy-coef", "-0.1"), ("--entropy-coef", "nan"),
                                  ("--entropy-floor", "-1"), ("--entropy-floor", "inf"), ("--batch-scales", "0"),
                                  ("--batch-scales", "1,x"), ("--batch-scales", "2"), ("--ppo-epochs", "0"),
                                  ("--omega", "nan"), ("--omega", "-1"), ("--step-latency-s", "-0.01"),
                                  ("--baseline-staleness", "4,x"), ("--baseline-staleness", "0"),
                                  ("--sweep-seeds", "0")])
def test_delay_names_a_bad_count_or_coefficient(flag):
    finished = subprocess.run([sys.executable, str(REPO / "benchmarks" / "delay.py"), *flag],
                              capture_output=True, text=True, timeout=60, cwd=REPO)
    assert finished.returncode == 2 and flag[0] in finished.stderr


# Every `python benchmarks/NAME.py ARGS` that README.md, docs/*.md or a script's own docstring prints, joined across
# `\` line continuations and cut at a comment, a closing backtick or a table bar. Synopses with [optional] parts
# are not commands. docs/research/ is not scanned: it cites commands as run at the commits it names, some with
# options since removed (`--entropy-per new-token`, `held+correction`).
DOCUMENTED = re.compile(r"python benchmarks/(\w+)\.py((?:\\\n|[^`\n#|)\\])*)")

PARSE_ONLY = """
import argparse, json, runpy, sys

class Parsed(Exception):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_only(self, *args, **kwargs):
    parse_args(self, *args, **kwargs)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_only
results = {}
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        results[" ".join(sys.argv)] = "ran without parsing its arguments"
    except Parsed:
        results[" ".join(sys.argv)] = "ok"
    except SystemExit as exit:
        results[" ".join(sys.argv)] = f"argparse refused it (exit {exit.code})"
print(json.dumps(results))
"""


# A fenced block opened with ```history holds the commands of measurements made with options since removed (they
# reproduce at the commit docs/research/log.md names, not at this one): not parsed here.
HISTORY = re.compile(r"^```history\n.*?^```$", re.MULTILINE | re.DOTALL)


def documented_benchmark_commands() -> list[tuple[str, list[str]]]:
    texts = [HISTORY.sub("", path.read_text())
             for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]]
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    texts += [ast.get_docstring(ast.parse(path.read_text())) or "" for path in scripts]
    commands = {}
    for text in texts:
        for match in DOCUMENTED.finditer(text):
            args = match.group(2).replace("\\\n", " ")
            if "[" not in args:
                commands[(match.group(1), " ".join(args.split()))] = None
    return [(f"benchmarks/{name}.py", shlex.split(args)) for name, args in commands]


def test_every_documented_benchmark_command_parses():
    """The long forms are too long for the suite; each is still parsed by its script's own argument parser, so a
    documented flag that was renamed or removed fails here (the script stops right after parsing)."""
    commands = documented_benchmark_commands()
    assert len(commands) >= 30 and any("--hours" in args for _, args in commands), commands
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY, json.dumps(commands)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert {command: result for command, result in results.items() if result != "ok"} == {}
    assert len(results) == len(commands)


@pytest.mark.slow
def test_engine_cache_quick():
    """Slow: SmolLM2-135M's shape at 2 layers plays 3 turns twice, with and without the cache (~10 s idle)."""
    result = run_benchmark("engine_cache.py", timeout_s=300)
    assert set(result["episode_s"]) == {"re-prefill", "cache"}
    # turns 2-3 feed only their 24 new tokens of contexts of 88-136: most prompt tokens come from the cache
    assert result["reuse_frac"] > 0.5


@pytest.mark.slow
def test_quick_start_quick():
    """The README's `async-rl train` through the script that times it: one short run, its summary line read; with
    `--against`, a second series whose override lands after the script's own (3 versions) and the pair's ratio."""
    result = run_benchmark("quick_start.py", 300, "--against", "run.max_versions=2")
    (run,), (other,) = result["runs"], result["against_runs"]
    assert run["versions"] == 3 and run["stop_reason"] == "max_versions" and run["env_steps"] > 0
    assert 0 < run["first_version_s"] < run["wall_s"] == result["wall_s_median"]
    assert other["versions"] == 2 and other["stop_reason"] == "max_versions"
    assert result["against"] == ["run.max_versions=2"]
    assert result["ratio_median"] == round(run["wall_s"] / other["wall_s"], 3)


@pytest.mark.slow
def test_worker_cpu_quick():
    """Slow: one run per arm (env calls inline, and on pools), each 15 s of vs_trl's task (~1 min idle): both
    measured from /proc and the worker's journal, the ratio of the two."""
    result = run_benchmark("worker_cpu.py", 300)
    runs = result["runs"]
    assert set(runs) == {"inline", "pools"} and all(len(r) == 1 for r in runs.values())
    for (run,) in runs.values():
        assert run["trajectories"] > 100 and run["seconds"] > 0
        assert all(run[f"{role}_ms"] > 0 for role in ("rollout-0", "replay", "learner"))
    assert result["ratio_inline_to_pools"] == result["worker_ms_per_trajectory"]["inline"] / result[
        "worker_ms_per_trajectory"]["pools"]


@pytest.mark.slow
def test_agent_endpoint_quick():
    """Slow: 8 conversations x 2 turns, three ways (the engine alone, the runner with a text env, agents through the
    OpenAI-compatible endpoint), every completion made in each (~15 s idle)."""
    result = run_benchmark("agent_endpoint.py", timeout_s=300)
    assert set(result["completions_per_s"]) == {"engine", "runner", "endpoint"}
    assert result["endpoint_vs_engine"] > 0 and result["endpoint_vs_runner"] > 0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")  # on the worker that holds the vLLM tests' pool (tests/conftest.py)
def test_engines_quick(vllm_servers):
    """Slow: the quick start's task for 3 versions on the built-in engine and on a real vLLM server (the pool's
    first, on its tiny model with vLLM-sized heads, the shape the script builds), each run's time and the ratio."""
    result = run_benchmark("engines.py", 400, "--engines", "torch,vllm", "--url", f"vllm={vllm_servers.urls[0]}",
                           "--model-dir", str(vllm_servers.model_dir))
    torch_run, vllm_run = result["engines"]["torch"]["runs"][0], result["engines"]["vllm"]["runs"][0]
    assert torch_run["versions"] == vllm_run["versions"] == 3 and vllm_run["env_steps"] > 0
    assert result["engines"]["vllm"]["ratio_to_torch"] == [vllm_run["wall_s"] / torch_run["wall_s"]]
    assert vllm_servers.servers[0].model_info()["weight_version"] == "3"  # the run's versions reached the server
