"""`env.name=verifiers` (rollout/agents/verifiers_env.py): a verifiers (v1) taskset, its harness and its rewards
trained through the agent env. The adapter's settings, split, outcome mapping and errors; then the no-network
taskset of tests/vf_tiny_taskset.py driving the real episode runner, torch engine and endpoint (each completion a
stage, the `@reward` the outcome, a harness that raises losing only its trajectory); and `async-rl train` on it
through real processes. Skipped without verifiers (`pip install 'async-rl[verifiers]'`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("verifiers.v1")

from async_rl.config_load import load_config  # noqa: E402
from async_rl.model import ensure_model_dir, load_tokenizer  # noqa: E402
from rollout.agents import verifiers_env  # noqa: E402
from rollout.engines import SamplingParams  # noqa: E402
from rollout.engines.torch_engine import TorchEngine  # noqa: E402
from rollout.envs.base import EnvError, load_factory, vocabulary_of  # noqa: E402
from rollout.runner import EpisodeRunner  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = {"id": "vf-tiny-taskset", "env": {"agent": {"runtime": {"type": "subprocess"}}}}


def test_the_verifiers_env_names_what_is_wrong():
    with pytest.raises(EnvError, match="env.kwargs.id: no verifiers taskset 'no-such-taskset'"):
        load_factory("verifiers", {"id": "no-such-taskset"})
    with pytest.raises(EnvError, match="raised RuntimeError: this taskset cannot be built"):
        load_factory("verifiers", {**TINY, "args": {"fail_init": True}})
    with pytest.raises(EnvError, match="raised RuntimeError loading its tasks: this taskset's rows are gone"):
        load_factory("verifiers", {**TINY, "args": {"fail_load": True}})
    with pytest.raises(EnvError, match="has 1 task"):
        load_factory("verifiers", {**TINY, "args": {"tasks": 1}})
    with pytest.raises(EnvError, match="env.kwargs.tasks: env 'verifiers' takes no such setting"):
        load_factory("verifiers", {**TINY, "tasks": "x.jsonl"})
    with pytest.raises(EnvError, match="env.kwargs.env: the taskset is env.kwargs.id"):
        load_factory("verifiers", {"id": "vf-tiny-taskset", "env": {"taskset": {"id": "x"}}})
    with pytest.raises(EnvError, match="verifiers refused the env config"):
        load_factory("verifiers", {**TINY, "args": {"tasks": "many"}})


def test_without_verifiers_the_error_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    with pytest.raises(EnvError, match=r"verifiers \(the environments\) is not installed "
                                       r"\(pip install 'async-rl\[verifiers\]'\)"):
        load_factory("verifiers", TINY)


def test_the_tasks_are_the_tasksets_split_train_and_eval():
    factory = load_factory("verifiers", {**TINY, "args": {"tasks": 10}, "eval_fraction": 0.3})
    try:
        train, held = factory.tasks("train"), factory.tasks("eval")
        assert len(train) == 7 and len(held) == 3
        assert sorted(t.id for t in train + held) == sorted(f"t{i}" for i in range(10))
        assert {t.data["prompt"] for t in held} <= {f"say yes {i}" for i in range(10)}
        assert vocabulary_of("verifiers", factory) == ["yes", "no", "maybe", "again"]
        assert factory.metrics()["agent_started"] == 0 and factory.loop is None  # nothing served before a trajectory
    finally:
        factory.close()


def _trace(reward, metrics=None, errors=()):
    return SimpleNamespace(reward=reward, metrics=metrics or {}, errors=list(errors))


def test_an_episodes_score_is_the_outcome():
    ok = SimpleNamespace(ok=True, errors=[], traces=[_trace(1.0, {"turns": 2.0}), _trace(0.5, {"turns": 4.0})])
    assert verifiers_env.outcome(ok, 1.0) == {"turns": 3.0, "reward": 0.75, "success": False}
    assert verifiers_env.outcome(ok, 0.7)["success"] is True
    broken = SimpleNamespace(ok=False, errors=[SimpleNamespace(type="HarnessError", message="exited 1")], traces=[])
    with pytest.raises(RuntimeError, match="the verifiers episode failed: HarnessError: exited 1"):
        verifiers_env.outcome(broken, 1.0)
    with pytest.raises(RuntimeError, match="no trace"):
        verifiers_env.outcome(SimpleNamespace(ok=True, errors=[], traces=[]), 1.0)


def _sink():
    sink = SimpleNamespace(stages={}, outcomes={})
    sink.stage = lambda episode, generation, reward, terminal: sink.stages.setdefault(
        episode.trajectory_id, []).append((episode.task, list(generation.token_ids), reward))
    sink.outcome = lambda episode, judgement, reason: sink.outcomes.__setitem__(
        episode.trajectory_id, (episode.task, judgement, reason))
    return sink


def _run_all(tmp_path, settings, deadline_s=90.0):
    """Every task of the factory once through the real runner, engine and endpoint: (sink, stats, counts,
    tokenizer)."""
    factory = load_factory("verifiers", settings)
    config = load_config(None, [f"run.dir={tmp_path}", "run.seed=2"])
    model_dir = ensure_model_dir(config.model, config.run_dir, config.run.seed, vocabulary_of("verifiers", factory))
    tokenizer = load_tokenizer(model_dir)
    sink = _sink()
    params = SamplingParams(max_new_tokens=6, stop_token_ids=[tokenizer.eos_token_id])
    runner = EpisodeRunner("verifiers", factory, TorchEngine(model_dir, seed=0), tokenizer, params, 512, sink, 8,
                           step_timeout_s=settings.get("timeout_s", 60.0), judge_timeout_s=60.0)
    try:
        for n, task in enumerate(factory.tasks("train") + factory.tasks("eval")):
            runner.start_group(f"g{n}", task, 1)
        deadline = time.monotonic() + deadline_s
        while not runner.idle():
            assert time.monotonic() < deadline, "the episodes did not end"
            runner.pump(0.05)
        return sink, runner.take_stats(), factory.metrics(), tokenizer
    finally:
        runner.close()
        factory.close()


def test_the_harness_completions_are_stages_and_its_reward_the_outcome(tmp_path):
    """Three tasks, the first one's harness raising: two trajectories of two stages each, judged by the task's
    `@reward` on the last reply the harness got (what the second stage sampled); the third lost and counted."""
    import vf_tiny_taskset

    vf_tiny_taskset.SEEN.clear()
    sink, stats, counts, tokenizer = _run_all(tmp_path, {**TINY, "args": {"tasks": 3, "first": "boom"},
                                                         "eval_fraction": 0.34, "timeout_s": 60})
    judged = {task.id: (judgement, reason) for task, judgement, reason in sink.outcomes.values()}
    assert sorted(judged) == ["t0", "t1", "t2"], sink.outcomes
    lost, why = judged.pop("t0")  # its harness raised: the trajectory is lost, with the reason
    assert lost is None and why.startswith("env_error: env 'verifiers': the agent raised RuntimeError: the verifiers "
                                           "episode failed: HarnessError") and "the harness broke on this task" in why
    for stages in sink.stages.values():
        task = stages[0][0]
        if task.id == "t0":
            continue
        replies = [tokenizer.decode(tokens, skip_special_tokens=True) for _, tokens, _ in stages]
        assert len(stages) == 2 and replies == vf_tiny_taskset.SEEN[task.data["prompt"]]
        assert [reward for _, _, reward in stages] == [0.0, 0.0]  # v1 scores traces, not turns
        judgement, reason = judged[task.id]
        assert reason == "" and judgement.score == pytest.approx(vf_tiny_taskset.score(replies[-1].strip()))
        assert judgement.info == {"turns": 2.0} and judgement.success == (judgement.score >= 1.0)
    assert counts["agent_errors"] == 1 and counts["agent_returned"] == 2 and counts["agent_completions"] == 4
    assert stats["trajectories_finished"] == 2


def test_an_episode_that_stalls_is_cancelled_at_the_time_limit(tmp_path):
    import vf_tiny_taskset

    vf_tiny_taskset.SEEN.clear()
    sink, _, counts, _ = _run_all(tmp_path, {**TINY, "args": {"tasks": 2, "first": "hang"}, "eval_fraction": 0.5,
                                             "timeout_s": 3})
    judged = {task.id: (judgement, reason) for task, judgement, reason in sink.outcomes.values()}
    assert judged["t0"][0] is None and judged["t1"][0] is not None and judged["t1"][1] == ""
    assert counts["agent_timeouts"] == 1 and counts["agent_returned"] == 1
    deadline = time.monotonic() + 10
    while "hang" not in vf_tiny_taskset.SEEN and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vf_tiny_taskset.SEEN["hang"] == ["cancelled"]  # verifiers' episode itself was cancelled


def test_an_exit_inside_verifiers_loses_the_episodes_not_the_worker(tmp_path, monkeypatch):
    """verifiers' default runtime is a Prime sandbox, whose tunnel raises SystemExit without `prime login`: each
    episode is lost at once with that message, and the worker (here the test) goes on."""
    monkeypatch.delenv("PRIME_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no Prime CLI config either
    sink, _, counts, _ = _run_all(tmp_path, {"id": "vf-tiny-taskset", "args": {"tasks": 2}, "eval_fraction": 0.5,
                                             "timeout_s": 60}, deadline_s=60)
    reasons = [reason for _, judgement, reason in sink.outcomes.values() if judgement is None]
    assert len(reasons) == 2 and all("verifiers exited: not authenticated with prime" in r for r in reasons)
    assert counts["agent_errors"] == 2


@pytest.mark.slow
def test_a_verifiers_taskset_trains_through_real_processes(tmp_path):
    """`async-rl train env.name=verifiers` on the tiny taskset: replay, learner and a worker whose episodes are
    verifiers' own; its completions arrive as stages, the ledger holds, the outcomes are the taskset's rewards."""
    from project_commands import project_command

    kwargs = json.dumps(TINY["env"]).replace(" ", "")
    command = [project_command(), "train", "env.name=verifiers", "env.kwargs.id=vf-tiny-taskset",
               f"env.kwargs.env={kwargs}", "env.kwargs.timeout_s=60", f"run.dir={tmp_path / 'runs'}",
               "run.max_versions=3", "run.target_success=null", "run.eval_samples_per_task=1",
               "rollout.max_new_tokens=6"]
    path = os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "local"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stop_reason"] == "max_versions", result
    # the final evaluation: the held-out task's episode scored by its @reward (a share of "yes" words), its
    # @metric `turns` averaged as eval_turns
    assert result["eval_tasks"] == 1 and result["eval_abandoned"] == 0 and result["eval_turns"] == 2.0
    assert 0.0 <= result["eval_score_mean"] <= 1.0
    learner = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert learner and all(m["ledger_residual_max"] < 1e-6 for m in learner)
    assert sum(m["items_immediate"] + m["items_correction"] for m in learner) > 0
    worker = [json.loads(line) for line in (run_dir / "metrics" / "rollout-0.jsonl").read_text().splitlines()]
    last = worker[-1]
    assert last["agent_completions"] > 0 and last["agent_returned"] > 0 and last["agent_errors"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["env_steps"] <= last["agent_completions"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-n", "0", "-q"]))
