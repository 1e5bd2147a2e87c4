"""Rollout components built from a run's config the way the role's entries build them (rollout/settings.py
`RolloutSettings.from_config`), for tests that start from a config."""

from __future__ import annotations

from pathlib import Path

from async_rl.config import Config, RolloutConfig, SGLangConfig, VLLMConfig
from rollout.envs.base import EnvFactory
from rollout.prepare import prepare_model_dir
from rollout.settings import RolloutSettings, SGLangSettings, VLLMSettings


def settings_of(config: Config) -> RolloutSettings:
    return RolloutSettings.from_config(config)


def model_dir_for(config: Config, factory: EnvFactory | None = None) -> Path:
    """The model directory a rollout worker of `config` prepares (rollout/prepare.py `prepare_model_dir`)."""
    return prepare_model_dir(settings_of(config).model_dir, factory)


def sglang_settings(**keys) -> SGLangSettings:
    """The SGLang engine's settings of a config whose `rollout.sglang` section has `keys` (the rest its defaults)."""
    return settings_of(Config(rollout=RolloutConfig(sglang=SGLangConfig(**keys)))).engine.sglang


def vllm_settings(**keys) -> VLLMSettings:
    """The vLLM engine's settings of a config whose `rollout.vllm` section has `keys` (the rest its defaults)."""
    return settings_of(Config(rollout=RolloutConfig(vllm=VLLMConfig(**keys)))).engine.vllm
