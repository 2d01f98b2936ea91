"""miles_ray: Ray-native LLM RL post-training (GRPO, PPO) that runs end to end on a CPU and scales to GPU clusters.

Five standalone actors, each with a typed config beside it:

- ``TrainerGroup`` (trainer ranks: torch FSDP2/DDP or megatron-core backend, one RL step for both)
- ``RolloutPool`` (rollout engines; the embedded pure-PyTorch engine by default, or vLLM / SGLang servers)
- ``Router`` (load balancing, health checks, eviction)
- ``ReplayBuffer`` (sample groups by reference, staleness bound)
- ``WeightBroadcaster`` (trainer -> engine weight sync, bucketed, versioned, verified)
- fully async rollout: ``AsyncRollout`` streams sample groups into the buffer while the trainer trains
- for PPO: ``CriticGroup`` (value model ranks) and ``ReferenceGroup`` (frozen reference ranks)

``miles_ray.placement`` plans colocated or disaggregated placement groups; ``miles_ray.stack.build_stack`` builds
the whole stack from its configs in one call. See ``examples/quickstart.py``.
"""

from miles_ray.deprecation import moved
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.engines.sglang import SGLangEngineConfig
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.hooks import TrainerHooksConfig
from miles_ray.lazy import lazy
from miles_ray.types import GroupRef, Prompt, RolloutBatch, Sample

# the actors, the stack and placement import Ray: they load on first use, so the engine, the trainer backends,
# the RL step and the sync transports import without Ray (tests/unit/test_ray_free.py checks it)
_ACTORS = "miles_ray.actors"
__getattr__ = lazy(
    __name__,
    {
        **{
            name: f"{_ACTORS}:{name}"
            for name in (
                "AsyncRollout",
                "AsyncRolloutConfig",
                "CriticGroup",
                "CriticGroupConfig",
                "ReferenceGroup",
                "ReferenceGroupConfig",
                "ReplayBuffer",
                "ReplayBufferConfig",
                "RolloutPool",
                "RolloutPoolConfig",
                "Router",
                "RouterConfig",
                "TrainerGroup",
                "TrainerGroupConfig",
                "WeightBroadcaster",
                "WeightBroadcasterConfig",
                "WeightSyncError",
            )
        },
        "Stack": "miles_ray.stack:Stack",
        "StackConfig": "miles_ray.stack:StackConfig",
        "build_stack": "miles_ray.stack:build_stack",
        "placement": "miles_ray.placement",
    },
    # names of earlier releases: they resolve, with a DeprecationWarning naming the new one
    fallback=moved(
        __name__,
        {
            "RolloutWorker": "miles_ray.actors.async_rollout:AsyncRollout",
            "RolloutWorkerConfig": "miles_ray.actors.async_rollout:AsyncRolloutConfig",
        },
    ),
)

__version__ = "0.1.0"

__all__ = [
    "AsyncRollout",
    "AsyncRolloutConfig",
    "CriticGroup",
    "CriticGroupConfig",
    "EmbeddedEngineConfig",
    "GenerateRequest",
    "GroupRef",
    "HttpServerConfig",
    "Prompt",
    "ReferenceGroup",
    "ReferenceGroupConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "RolloutBatch",
    "RolloutPool",
    "RolloutPoolConfig",
    "Router",
    "RouterConfig",
    "Sample",
    "SamplingParams",
    "Stack",
    "StackConfig",
    "TrainerGroup",
    "TrainerGroupConfig",
    "TrainerHooksConfig",
    "SGLangEngineConfig",
    "VLLMEngineConfig",
    "WeightBroadcaster",
    "WeightBroadcasterConfig",
    "WeightSyncError",
    "build_stack",
    "placement",
]
