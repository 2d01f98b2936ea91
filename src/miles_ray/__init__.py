"""miles_ray: Ray-native LLM RL post-training (GRPO, PPO) that runs end to end on a CPU and scales to GPU clusters.

Five standalone actors, each with a typed config beside it:

- ``TrainerGroup`` (trainer ranks, torch FSDP2/DDP backend)
- ``RolloutPool`` (rollout engines; the embedded pure-PyTorch engine by default, or vLLM servers)
- ``Router`` (load balancing, health checks, eviction)
- ``ReplayBuffer`` (sample groups by reference, staleness bound)
- ``WeightBroadcaster`` (trainer -> engine weight sync, bucketed, versioned, verified)
- fully async rollout: ``RolloutWorker`` streams sample groups into the buffer while the trainer trains
- for PPO: ``CriticGroup`` (value model ranks) and ``ReferenceGroup`` (frozen reference ranks)

``miles_ray.placement`` plans colocated or disaggregated placement groups. See ``examples/quickstart.py``.
"""

from miles_ray import placement
from miles_ray.actors import (
    CriticGroup,
    CriticGroupConfig,
    GroupRef,
    ReferenceGroup,
    ReferenceGroupConfig,
    ReplayBuffer,
    ReplayBufferConfig,
    RolloutPool,
    RolloutPoolConfig,
    RolloutWorker,
    RolloutWorkerConfig,
    Router,
    RouterConfig,
    TrainerGroup,
    TrainerGroupConfig,
    WeightBroadcaster,
    WeightBroadcasterConfig,
    WeightSyncError,
)
from miles_ray.engines.base import GenerateRequest, SamplingParams
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.sglang import SGLangEngineConfig
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.hooks import TrainerHooksConfig
from miles_ray.types import RolloutBatch, Sample

__version__ = "0.1.0"

__all__ = [
    "CriticGroup",
    "CriticGroupConfig",
    "EmbeddedEngineConfig",
    "GenerateRequest",
    "GroupRef",
    "HttpServerConfig",
    "ReferenceGroup",
    "ReferenceGroupConfig",
    "RolloutWorker",
    "RolloutWorkerConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "RolloutBatch",
    "RolloutPool",
    "RolloutPoolConfig",
    "Router",
    "RouterConfig",
    "Sample",
    "SamplingParams",
    "TrainerGroup",
    "TrainerGroupConfig",
    "TrainerHooksConfig",
    "SGLangEngineConfig",
    "VLLMEngineConfig",
    "WeightBroadcaster",
    "WeightBroadcasterConfig",
    "WeightSyncError",
    "placement",
]
