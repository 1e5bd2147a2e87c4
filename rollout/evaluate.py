"""Evaluate a policy on the environment's eval split: the success rate of fresh samples, with no training.

The training metric `success_rate` covers the last 64 finished trajectories, i.e. a handful of groups of a handful
of tasks, so it is noisy and can touch the target on a lucky window. This measures a policy on every eval task,
`samples_per_task` trajectories each, sampled exactly as in training and by the same episode runner
(rollout/runner.py). `blind=True` replaces every tool answer with a fixed string: how much the policy needs its
observations.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from async_rl.config import Config
from async_rl.errors import AsyncRLError
from async_rl.model import load_tokenizer
from rollout.engines import Generation, InferenceEngine, SamplingParams
from rollout.engines.thread import EngineThread
from rollout.engines.torch_engine import TorchEngine, configured_device
from rollout.envs.base import EnvFactory, Judgement, Task, checked_tasks, close_factory
from rollout.episode import Episode
from rollout.prepare import load_env, prepare_model_dir
from rollout.runner import EpisodeRunner
from rollout.settings import EvalSettings, RolloutSettings

log = logging.getLogger("async_rl.rollout")


def latest_weights(run_dir: Path) -> tuple[int, Path | None]:
    """The newest published version and its safetensors file (an SGLang disk-sync run publishes HF directories:
    their model.safetensors)."""
    latest = run_dir / "weights" / "latest.json"
    if not latest.exists():
        return 0, None
    notice = json.loads(latest.read_text())
    path = Path(notice["path"])
    return notice["version"], path / "model.safetensors" if path.is_dir() else path


class TallySink:
    """Collects each eval trajectory's judgement (None: abandoned) by task."""

    def __init__(self) -> None:
        self.judgements: dict[str, list[Judgement | None]] = {}
        self.stage_rewards: list[float] = []
        self.turns: list[int] = []

    def stage(self, episode: Episode, generation: Generation, reward: float, terminal: bool) -> None:
        self.stage_rewards.append(reward)

    def outcome(self, episode: Episode, judgement: Judgement | None, reason: str) -> None:
        self.judgements.setdefault(episode.task.id, []).append(judgement)
        self.turns.append(episode.stages)


def evaluate_policy(
    settings: EvalSettings,
    env_name: str,
    factory: EnvFactory,
    engine: InferenceEngine | EngineThread,
    tokenizer: Any,
    params: SamplingParams | None = None,
    samples_per_task: int | None = None,
    blind: bool = False,
    service: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Run `samples_per_task` episodes of every eval task of the env `env_name` (at most `run.eval_max_tasks`) with
    the engine's current weights (a worker passes the EngineThread it trains with: the calls queue on one thread),
    sampled with `params` (default: as `rollout.*` says); `service` is called between rounds (a training worker keeps
    its leases alive)."""
    samples = samples_per_task or max(1, settings.eval_samples_per_task)
    tasks: list[Task] = checked_tasks(env_name, factory, "eval")[: settings.eval_max_tasks]
    sink = TallySink()
    inflight = max(settings.runner.max_inflight, samples)
    runner = EpisodeRunner.from_settings(settings.runner, env_name, factory, engine, tokenizer, sink, params, inflight,
                                         blind)
    pending = list(enumerate(tasks))
    try:
        with torch.inference_mode():
            while pending or not runner.idle():
                while pending and runner.room_for(samples):
                    n, task = pending.pop(0)
                    runner.start_group(f"eval{n}", task, samples)
                runner.pump(0.05)
                service()
    finally:
        runner.close()
    return summarize(sink, tasks, samples, engine.version, blind)


def summarize(sink: TallySink, tasks: list[Task], samples: int, version: int, blind: bool) -> dict[str, Any]:
    per_task, scores, info = [], [], {}
    abandoned = 0
    for task in tasks:
        judged = sink.judgements.get(task.id, [])
        per_task.append(sum(j is not None and j.success for j in judged) / samples)
        for judgement in judged:
            if judgement is None:
                abandoned += 1
                continue
            scores.append(judgement.score)
            for key, value in judgement.info.items():
                info.setdefault(key, []).append(value)
    total = samples * len(tasks)
    result: dict[str, Any] = {
        "eval_success_rate": sum(rate * samples for rate in per_task) / total,
        "eval_score_mean": sum(scores) / total,
        "eval_version": version,
        "eval_tasks": len(tasks),
        "eval_tasks_solved": sum(rate >= 0.8 for rate in per_task),
        "eval_abandoned": abandoned,
        "eval_turns_mean": sum(sink.turns) / max(1, len(sink.turns)),
        "eval_stage_reward_mean": sum(sink.stage_rewards) / max(1, len(sink.stage_rewards)),
    }
    for key, values in sorted(info.items()):
        result[f"eval_{key}"] = sum(values) / total
    if blind:
        result["eval_blind"] = True
    result["eval_per_task"] = [round(rate, 4) for rate in per_task]
    return result


def evaluate(config: Config, samples_per_task: int = 16, seed: int = 12345, blind: bool = False) -> dict[str, Any]:
    """The run's latest published weights (version 0 if none) on every eval task (the entry of `async-rl
    evaluate`: the components' settings are read from the config here)."""
    settings = RolloutSettings.from_config(config)
    factory = load_env(settings.env)
    if not config.model.path and not (config.run_dir / "model" / "config.json").exists():
        raise AsyncRLError(f"no run at {config.run_dir} (no model directory): evaluate a run that exists "
                           "(set run.dir / run.name, or --config <run_dir>/config.yaml)")
    model_dir = prepare_model_dir(settings.model_dir, factory)
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(model_dir, seed=seed, device=configured_device(settings.engine.device),
                         cache_mib=settings.engine.prefix_cache_mib)
    version, path = latest_weights(config.run_dir)
    if path is not None:
        engine.update_weights(version, str(path))
    try:
        result = evaluate_policy(settings.eval, settings.env.name, factory, engine, tokenizer, None, samples_per_task,
                                 blind)
    finally:
        engine.close()
        close_factory(settings.env.name, factory)
    log.info("evaluation of version %d: %s", version, result)
    return result
