"""Inference engines: the interface (`base`), the built-in PyTorch engine (`torch_engine`), SGLang (`sglang`)."""

from rollout.engines.base import EngineStopped, EngineUnavailable, Generation, InferenceEngine, SamplingParams

__all__ = ["EngineStopped", "EngineUnavailable", "Generation", "InferenceEngine", "SamplingParams"]
