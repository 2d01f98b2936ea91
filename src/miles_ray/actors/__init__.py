"""The five actors: TrainerGroup, RolloutPool, Router, ReplayBuffer, WeightBroadcaster (with their configs)."""

from miles_ray.actors.replay_buffer import GroupRef, ReplayBuffer, ReplayBufferConfig
from miles_ray.actors.rollout_pool import EngineActor, RolloutPool, RolloutPoolConfig
from miles_ray.actors.router import NoHealthyEngineError, Router, RouterConfig
from miles_ray.actors.trainer_group import TrainerGroup, TrainerGroupConfig, TrainerWorker
from miles_ray.actors.weight_broadcaster import WeightBroadcaster, WeightBroadcasterConfig, WeightSyncError

__all__ = [
    "EngineActor",
    "GroupRef",
    "NoHealthyEngineError",
    "ReplayBuffer",
    "ReplayBufferConfig",
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
