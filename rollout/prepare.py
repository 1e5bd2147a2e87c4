"""What every rollout-side entry point does first: load the configured environment and the model directory for it.

The tiny default model's tokenizer depends on the environment (word-level over its declared vocabulary, else
byte-level), so the rollout side builds the model directory (atomically: several workers may race for it, the
copies are identical) and the learner waits for it (async_rl.model.wait_for_model_dir).
"""

from __future__ import annotations

from pathlib import Path

from async_rl.config import Config
from async_rl.model import ensure_model_dir
from rollout.envs.base import EnvFactory, load_factory, vocabulary_of


def load_env(config: Config) -> EnvFactory:
    return load_factory(config.env.name, config.env.kwargs)


def prepare_model_dir(config: Config, factory: EnvFactory | None = None) -> Path:
    """The model directory, built for the environment's vocabulary when the tiny model is used."""
    if config.model.path:
        return ensure_model_dir(config)
    factory = factory if factory is not None else load_env(config)
    return ensure_model_dir(config, vocabulary_of(config.env.name, factory))
