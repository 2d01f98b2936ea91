"""The actors, each with its config: the five core ones, the fully async rollout, PPO's critic and reference.

The engine actors (``EmbeddedEngineActor``, ``VLLMEngineActor``, ``SGLangEngineActor``) are started by the
``RolloutPool``; their contract is ``engine_actor.EngineInterface``.
"""

from miles_ray.actors.async_rollout import AsyncRollout, AsyncRolloutConfig
from miles_ray.actors.critic_group import CriticGroup, CriticGroupConfig
from miles_ray.actors.embedded_engine import EmbeddedEngineActor
from miles_ray.actors.engine_actor import EngineControl, EngineInterface, InFlight
from miles_ray.actors.reference import ReferenceGroup, ReferenceGroupConfig
from miles_ray.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from miles_ray.actors.reward_model import ModelReward, RewardModelConfig, RewardModelGroup
from miles_ray.actors.rollout_pool import RolloutPool, RolloutPoolConfig
from miles_ray.actors.router import NoHealthyEngineError, Router, RouterConfig
from miles_ray.actors.trainer_group import TrainerGroup, TrainerGroupConfig, TrainerWorker
from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig, WeightSyncError
from miles_ray.deprecation import moved

# names of earlier releases: they resolve, with a DeprecationWarning naming the new one
__getattr__ = moved(
    __name__,
    {
        "EngineActor": "miles_ray.actors.embedded_engine:EmbeddedEngineActor",
        "GroupRef": "miles_ray.types:GroupRef",
        "RolloutWorker": "miles_ray.actors.async_rollout:AsyncRollout",
        "RolloutWorkerConfig": "miles_ray.actors.async_rollout:AsyncRolloutConfig",
    },
)

__all__ = [
    "AsyncRollout",
    "AsyncRolloutConfig",
    "CriticGroup",
    "CriticGroupConfig",
    "EmbeddedEngineActor",
    "EngineControl",
    "EngineInterface",
    "InFlight",
    "NoHealthyEngineError",
    "ReferenceGroup",
    "ReferenceGroupConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "ModelReward",
    "RewardModelConfig",
    "RewardModelGroup",
    "RolloutPool",
    "RolloutPoolConfig",
    "Router",
    "RouterConfig",
    "TrainerGroup",
    "TrainerGroupConfig",
    "TrainerWorker",
    "WeightBroadcaster",
    "WeightBroadcasterConfig",
    "WeightSyncError",
]
