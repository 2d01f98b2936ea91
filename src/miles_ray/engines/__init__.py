"""Rollout engines: the embedded pure-PyTorch engine (default), vLLM and SGLang servers, and their request types."""

from miles_ray.engines.requests import Completion, EngineDeadError, GenerateOutput, GenerateRequest, SamplingParams
from miles_ray.engines.sglang import SGLangEngineConfig, SGLangLoRAConfig
from miles_ray.engines.vllm import VLLMEngineConfig

__all__ = [
    "Completion",
    "EngineDeadError",
    "GenerateOutput",
    "GenerateRequest",
    "SamplingParams",
    "SGLangEngineConfig",
    "SGLangLoRAConfig",
    "VLLMEngineConfig",
]
