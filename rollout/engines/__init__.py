"""Inference engines: the interface (`base`) and the built-in PyTorch engine (`torch_engine`)."""

from rollout.engines.base import Generation, InferenceEngine, SamplingParams

__all__ = ["Generation", "InferenceEngine", "SamplingParams"]
