"""What each of the rollout worker's components reads of the run's config, one frozen struct per component, built
once at the entry (rollout/worker.py `run`, rollout/evaluate.py `evaluate`) by `RolloutSettings.from_config`: the one
reader of `Config` below the entries.

A field keeps its config key's name (`ack_timeout_s` is `rollout.ack_timeout_s`), so a key is followed from its YAML
line to the components that read it by its name; a component gets its own struct and nothing else of the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from async_rl.config import Config, ModelConfig
from async_rl.config_load import config_to_dict
from async_rl.telemetry import MetricsSettings


class EnvSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The environment (rollout/prepare.py `load_env`) and the order a worker draws its tasks in."""

    name: str  # env.name
    kwargs: dict[str, Any]  # env.kwargs
    seed: int  # env.seed


class ModelDirSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The model directory (rollout/prepare.py `prepare_model_dir`, async_rl/model.py `ensure_model_dir`)."""

    model: ModelConfig  # model (the section as a whole: its path, or the sizes the tiny model is built from)
    run_dir: Path  # run.dir / run.name (the tiny model is built in <run_dir>/model)
    seed: int  # run.seed (the tiny model's random init)
    env: EnvSettings  # the environment, whose vocabulary is the tiny model's tokenizer


class SGLangSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The SGLang engine's client (rollout/engines/sglang.py)."""

    urls: list[str]  # rollout.sglang.urls
    weight_sync: Literal["disk", "distributed"]  # rollout.sglang.weight_sync
    pause_mode: Literal["in_place", "abort"]  # rollout.sglang.pause_mode
    request_timeout_s: float  # rollout.sglang.request_timeout_s
    max_retries: int  # rollout.sglang.max_retries
    partial_rollouts: bool  # rollout.sglang.partial_rollouts
    unavailable_timeout_s: float  # rollout.sglang.unavailable_timeout_s
    api_key_file: str | None  # rollout.sglang.api_key_file
    ca_file: str | None = None  # rollout.sglang.ca_file


class VLLMSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The vLLM engine's client (rollout/engines/vllm.py): the SGLang client's fields, from `rollout.vllm`."""

    urls: list[str]  # rollout.vllm.urls
    weight_sync: Literal["disk", "distributed"]  # rollout.vllm.weight_sync
    pause_mode: Literal["in_place", "abort", "keep"]  # rollout.vllm.pause_mode
    request_timeout_s: float  # rollout.vllm.request_timeout_s
    max_retries: int  # rollout.vllm.max_retries
    partial_rollouts: bool  # rollout.vllm.partial_rollouts
    unavailable_timeout_s: float  # rollout.vllm.unavailable_timeout_s
    api_key_file: str | None  # rollout.vllm.api_key_file
    ca_file: str | None = None  # rollout.vllm.ca_file


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Which inference engine, and its settings (rollout/worker.py `make_engine`, rollout/evaluate.py's engine)."""

    engine: Literal["torch", "sglang", "vllm"]  # rollout.engine
    device: Literal["auto", "cpu", "cuda"]  # rollout.device (the built-in engine)
    prefix_cache_mib: float  # rollout.prefix_cache_mib (the built-in engine)
    sglang: SGLangSettings  # rollout.sglang
    vllm: VLLMSettings  # rollout.vllm


class RunnerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The episode runner (rollout/runner.py `EpisodeRunner.from_settings`): its sampling (`sampling_params`), its env
    calls' time limits (rollout/plugin_calls.py `call_limits`), its tool parser and its batching."""

    max_seq_len: int  # model.max_seq_len
    temperature: float  # rollout.temperature
    top_p: float  # rollout.top_p
    max_new_tokens: int | None  # rollout.max_new_tokens
    stop: list[str]  # rollout.stop
    tool_parser: Literal["hermes", "none"]  # rollout.tool_parser
    max_inflight: int  # rollout.max_inflight
    engine_batch_wait_s: float  # rollout.engine_batch_wait_s
    inline_budget_s: float  # rollout.inline_budget_s (a worker's runner only: rollout/worker.py)
    step_timeout_s: float | None  # rollout.step_timeout_s
    judge_timeout_s: float | None  # rollout.judge_timeout_s


class EvalSettings(msgspec.Struct, frozen=True, kw_only=True):
    """An evaluation on the eval split (rollout/evaluate.py `evaluate_policy`), and how often worker 0 runs one."""

    eval_samples_per_task: int  # run.eval_samples_per_task
    eval_max_tasks: int | None  # run.eval_max_tasks
    eval_every: int  # run.eval_every (rollout/worker.py: worker 0 only)
    runner: RunnerSettings  # the episodes are run as in training


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's loop and links (rollout/worker.py): its sockets, acks, leases, metrics lines and seeds."""

    seed: int  # run.seed (each worker's engine samples from seed * 1000 + its index)
    threads_per_process: int  # run.threads_per_process
    metrics_every_s: float  # run.metrics_every_s
    run_dir: Path  # run.dir / run.name (weights/latest.json, the ack journal)
    group_size: int  # rollout.group_size
    max_inflight: int  # rollout.max_inflight (room for a group: the runner's own)
    ack_timeout_s: float  # rollout.ack_timeout_s
    heartbeat_s: float  # rollout.heartbeat_s
    endpoint: str  # replay.endpoint
    publish_endpoint: str  # learner.publish_endpoint
    curve_dir: str | None  # security.curve_dir (the worker's own key)
    insecure: bool  # security.insecure (tcp:// without keys allowed)


class RolloutSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Each component's struct, and the role's metrics (async_rl/telemetry.py)."""

    worker: WorkerSettings
    env: EnvSettings
    model_dir: ModelDirSettings
    engine: EngineSettings
    runner: RunnerSettings
    eval: EvalSettings
    metrics: MetricsSettings

    @classmethod
    def from_config(cls, config: Config) -> RolloutSettings:
        """The rollout side's settings from the run's config: called by the entries (rollout/worker.py `run`,
        rollout/evaluate.py `evaluate`) only."""
        run, rollout = config.run, config.rollout
        env = EnvSettings(name=config.env.name, kwargs=dict(config.env.kwargs), seed=config.env.seed)
        runner = RunnerSettings(
            max_seq_len=config.model.max_seq_len, temperature=rollout.temperature, top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens, stop=list(rollout.stop), tool_parser=rollout.tool_parser,
            max_inflight=rollout.max_inflight, engine_batch_wait_s=rollout.engine_batch_wait_s,
            inline_budget_s=rollout.inline_budget_s,
            step_timeout_s=rollout.step_timeout_s, judge_timeout_s=rollout.judge_timeout_s,
        )
        return cls(
            worker=WorkerSettings(seed=run.seed, threads_per_process=run.threads_per_process,
                                  metrics_every_s=run.metrics_every_s, run_dir=config.run_dir,
                                  group_size=rollout.group_size, max_inflight=rollout.max_inflight,
                                  ack_timeout_s=rollout.ack_timeout_s, heartbeat_s=rollout.heartbeat_s,
                                  endpoint=config.replay.endpoint, publish_endpoint=config.learner.publish_endpoint,
                                  curve_dir=config.security.curve_dir, insecure=config.security.insecure),
            env=env,
            model_dir=ModelDirSettings(model=config.model, run_dir=config.run_dir, seed=run.seed, env=env),
            engine=EngineSettings(
                engine=rollout.engine, device=rollout.device, prefix_cache_mib=rollout.prefix_cache_mib,
                # a server engine's client settings: its section's keys of the same names
                sglang=msgspec.convert(msgspec.to_builtins(rollout.sglang), SGLangSettings),
                vllm=msgspec.convert(msgspec.to_builtins(rollout.vllm), VLLMSettings),
            ),
            runner=runner,
            eval=EvalSettings(eval_samples_per_task=run.eval_samples_per_task, eval_max_tasks=run.eval_max_tasks,
                              eval_every=run.eval_every, runner=runner),
            metrics=MetricsSettings(run_dir=config.run_dir, name=run.name, wandb=config.wandb,
                                    run_config=config_to_dict(config)),
        )

