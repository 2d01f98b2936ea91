"""Rollout engines behind the ``RolloutEngine`` interface; the embedded pure-PyTorch engine is the default."""

from miles_ray.engines.base import Completion, GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams

__all__ = ["Completion", "GenerateOutput", "GenerateRequest", "RolloutEngine", "SamplingParams"]
