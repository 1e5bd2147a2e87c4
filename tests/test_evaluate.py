"""`async-rl evaluate`: the final weights on every eval task, sampled as in training, by the training runner."""

import json

from rollout_helpers import model_dir_for

from async_rl.config_load import load_config
from rollout.evaluate import evaluate


def trap(tmp_path, *overrides: str):
    return load_config(None, [f"run.dir={tmp_path}", *(f"env.kwargs.{o}" for o in overrides)])


def test_the_random_initial_policy_evaluates_near_chance(tmp_path):
    config = trap(tmp_path, "num_tasks=4", "stages=2", "traps=0")
    model_dir_for(config)
    result = evaluate(config, samples_per_task=32)
    assert result["eval_version"] == 0  # nothing published yet: the model directory's weights
    # One action token from a ~20-word vocabulary, 2 stages with a retry each: success is rare for a random policy.
    assert result["eval_success_rate"] < 0.2
    assert result["eval_tasks_solved"] == 0 and result["eval_tasks"] == 4
    assert result["eval_trap_rate"] == 0.0  # no traps in this env
    assert len(result["eval_per_task"]) == 4 and result["eval_abandoned"] == 0
    assert 1.0 <= result["eval_turns_mean"] <= 4.0


def test_trap_rate_counts_trajectories_that_took_a_trap(tmp_path):
    # One stage whose trap symbol is one of ~20 words: a near-uniform policy takes it on its first try or its
    # retry about 2/20 of the time.
    config = trap(tmp_path, "num_tasks=4", "stages=1", "traps=1")
    model_dir_for(config)
    result = evaluate(config, samples_per_task=64)
    assert 0.02 < result["eval_trap_rate"] < 0.3


def test_evaluation_uses_the_latest_published_weights(tmp_path):
    config = trap(tmp_path, "num_tasks=2", "stages=1", "traps=0")
    model_dir = model_dir_for(config)
    weights = config.run_dir / "weights"
    weights.mkdir(parents=True)
    (weights / "v7.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (weights / "latest.json").write_text(json.dumps({"version": 7, "path": str(weights / "v7.safetensors")}))
    assert evaluate(config, samples_per_task=4)["eval_version"] == 7


def test_blind_evaluation_replaces_every_tool_answer(tmp_path):
    config = load_config(None, [f"run.dir={tmp_path}", "env.name=hunt", "env.kwargs.num_tasks=2"])
    model_dir_for(config)
    result = evaluate(config, samples_per_task=8, blind=True)
    assert result["eval_blind"] is True and result["eval_tasks"] == 2


def test_evaluation_reads_an_hf_directory_published_for_sglang(tmp_path):
    config = trap(tmp_path, "num_tasks=2", "stages=1", "traps=0")
    model_dir = model_dir_for(config)
    published = config.run_dir / "weights" / "hf-v3"
    published.mkdir(parents=True)
    (published / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (config.run_dir / "weights" / "latest.json").write_text(json.dumps({"version": 3, "path": str(published)}))
    assert evaluate(config, samples_per_task=2)["eval_version"] == 3
