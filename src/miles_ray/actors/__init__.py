"""The actors, each with its config: the five core ones, the async RolloutWorker, PPO's critic and reference."""

from miles_ray.actors.critic_group import CriticGroup, CriticGroupConfig
from miles_ray.actors.reference import ReferenceGroup, ReferenceGroupConfig
from miles_ray.actors.replay_buffer import GroupRef, ReplayBuffer, ReplayBufferConfig
from miles_ray.actors.rollout_pool import EngineActor, RolloutPool, RolloutPoolConfig
from miles_ray.actors.rollout_worker import RolloutWorker, RolloutWorkerConfig
from miles_ray.actors.router import NoHealthyEngineError, Router, RouterConfig
from miles_ray.actors.trainer_group import TrainerGroup, TrainerGroupConfig, TrainerWorker
from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig, WeightSyncError

__all__ = [
    "CriticGroup",
    "CriticGroupConfig",
    "EngineActor",
    "GroupRef",
    "NoHealthyEngineError",
    "ReferenceGroup",
    "ReferenceGroupConfig",
    "ReplayBuffer",
    "ReplayBufferConfig",
    "RolloutPool",
    "RolloutPoolConfig",
    "RolloutWorker",
    "RolloutWorkerConfig",
    "Router",
    "RouterConfig",
    "TrainerGroup",
    "TrainerGroupConfig",
    "TrainerWorker",
    "WeightBroadcaster",
    "WeightBroadcasterConfig",
    "WeightSyncError",
]
