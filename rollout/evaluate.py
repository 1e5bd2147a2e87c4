"""Evaluate a policy on every task of the environment: the success rate of fresh samples, with no training.

The training metric `success_rate` covers the last 64 finished trajectories, i.e. a handful of groups of a handful
of tasks, so it is noisy and can touch the target on a lucky window. This measures the final weights on all
`env.num_tasks` tasks, `samples_per_task` trajectories each, sampled exactly as in training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import torch

from async_rl.config import Config
from async_rl.model import ensure_model_dir, load_tokenizer
from rollout.engines import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.envs.trap import TrapEnv

log = logging.getLogger("async_rl.rollout")


def latest_weights(run_dir: Path) -> tuple[int, Path | None]:
    latest = run_dir / "weights" / "latest.json"
    if not latest.exists():
        return 0, None
    notice = json.loads(latest.read_text())
    return notice["version"], Path(notice["path"])


def evaluate(config: Config, samples_per_task: int = 16, seed: int = 12345) -> dict[str, Any]:
    """Success rate of the run's latest published weights (version 0 if none) over every task, plus how often
    the policy takes a trap (`eval_trap_rate`) and on how many tasks it mostly does (`eval_tasks_trapped`)."""
    model_dir = ensure_model_dir(config)
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(model_dir, seed=seed)
    version, path = latest_weights(config.run_dir)
    if path is not None:
        engine.update_weights(version, str(path))
    # No simulated latency: evaluation measures the policy, not the tools.
    env_config = msgspec.structs.replace(config.env, step_latency_s=0.0, outcome_delay_s=0.0)
    params = SamplingParams(
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
        max_new_tokens=config.rollout.max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    successes = trapped = 0
    per_task, per_task_trapped = [], []
    with torch.inference_mode():
        for task_id in range(config.env.num_tasks):
            envs = [TrapEnv(env_config) for _ in range(samples_per_task)]
            contexts = [tokenizer(env.reset(task_id))["input_ids"] for env in envs]
            live = list(range(samples_per_task))
            while live:
                generations = engine.generate([contexts[i] for i in live], params)
                still = []
                for i, generation in zip(live, generations, strict=True):
                    action = tokenizer.decode(generation.token_ids, skip_special_tokens=True)
                    observation, _, done = envs[i].step(action)
                    contexts[i] += generation.token_ids + tokenizer(observation)["input_ids"]
                    if not done:
                        still.append(i)
                live = still
            task_successes = sum(env.outcome() >= 1.0 for env in envs)
            task_trapped = sum(env.trapped for env in envs)  # took a trap symbol: stage reward 1, outcome 0
            per_task.append(task_successes / samples_per_task)
            per_task_trapped.append(task_trapped / samples_per_task)
            successes += task_successes
            trapped += task_trapped
    engine.close()
    result = {
        "eval_success_rate": successes / (samples_per_task * config.env.num_tasks),
        "eval_version": version,
        "eval_tasks_solved": sum(rate >= 0.8 for rate in per_task),
        "eval_trap_rate": trapped / (samples_per_task * config.env.num_tasks),
        "eval_tasks_trapped": sum(rate >= 0.5 for rate in per_task_trapped),  # the policy learned the trap there
        "eval_per_task": [round(rate, 4) for rate in per_task],
    }
    log.info("evaluation of version %d: %s", version, result)
    return result
