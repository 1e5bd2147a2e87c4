"""`async-rl evaluate`: the final weights on every task, sampled as in training."""

import json

from async_rl.config import load_config
from async_rl.model import ensure_model_dir
from rollout.evaluate import evaluate


def test_the_random_initial_policy_evaluates_near_chance(tmp_path):
    config = load_config(None, [f"run.dir={tmp_path}", "env.num_tasks=4", "env.stages=2", "env.traps=0"])
    ensure_model_dir(config)
    result = evaluate(config, samples_per_task=32)
    assert result["eval_version"] == 0  # nothing published yet: the model directory's weights
    # One action token from a ~20-word vocabulary, 2 stages with a retry each: success is rare for a random policy.
    assert result["eval_success_rate"] < 0.2
    assert result["eval_tasks_solved"] == 0
    assert result["eval_trap_rate"] == 0.0 and result["eval_tasks_trapped"] == 0  # no traps in this env
    assert len(result["eval_per_task"]) == 4


def test_trap_rate_counts_trajectories_that_took_a_trap(tmp_path):
    # One stage whose trap symbol is one of ~20 words: a near-uniform policy takes it on its first try or its
    # retry about 2/20 of the time; a learned trap would be >= 0.5 on its task.
    config = load_config(None, [f"run.dir={tmp_path}", "env.num_tasks=4", "env.stages=1", "env.traps=1"])
    ensure_model_dir(config)
    result = evaluate(config, samples_per_task=64)
    assert 0.02 < result["eval_trap_rate"] < 0.3
    assert result["eval_tasks_trapped"] == 0


def test_evaluation_uses_the_latest_published_weights(tmp_path):
    config = load_config(None, [f"run.dir={tmp_path}", "env.num_tasks=2", "env.stages=1", "env.traps=0"])
    model_dir = ensure_model_dir(config)
    weights = config.run_dir / "weights"
    weights.mkdir(parents=True)
    (weights / "v7.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (weights / "latest.json").write_text(json.dumps({"version": 7, "path": str(weights / "v7.safetensors")}))
    assert evaluate(config, samples_per_task=4)["eval_version"] == 7
