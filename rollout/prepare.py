"""What every rollout-side entry point does first: load the configured environment and the model directory for it.

The tiny default model's tokenizer depends on the environment (word-level over its declared vocabulary, else
byte-level), so the rollout side builds the model directory (atomically: several workers may race for it, the
copies are identical) and the learner waits for it (async_rl.model.wait_for_model_dir).
"""

from __future__ import annotations

from pathlib import Path

from async_rl.model import ensure_model_dir
from rollout.envs.base import EnvFactory, load_factory, vocabulary_of
from rollout.settings import EnvSettings, ModelDirSettings


def load_env(env: EnvSettings) -> EnvFactory:
    return load_factory(env.name, env.kwargs)


def prepare_model_dir(settings: ModelDirSettings, factory: EnvFactory | None = None) -> Path:
    """The model directory, built for the environment's vocabulary when the tiny model is used."""
    if settings.model.path:
        return ensure_model_dir(settings.model, settings.run_dir, settings.seed)
    factory = factory if factory is not None else load_env(settings.env)
    return ensure_model_dir(settings.model, settings.run_dir, settings.seed, vocabulary_of(settings.env.name, factory))
