"""Rollout engines behind the ``RolloutEngine`` interface: the embedded pure-PyTorch engine (default), vLLM, SGLang."""

from miles_ray.engines.base import Completion, GenerateOutput, GenerateRequest, RolloutEngine, SamplingParams
from miles_ray.engines.sglang import SGLangEngineConfig, SGLangLoRAConfig
from miles_ray.engines.vllm import VLLMEngineConfig

__all__ = [
    "Completion",
    "GenerateOutput",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingParams",
    "SGLangEngineConfig",
    "SGLangLoRAConfig",
    "VLLMEngineConfig",
]
