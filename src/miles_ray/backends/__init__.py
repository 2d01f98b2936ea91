"""Training backends (torch FSDP2/DDP, megatron-core) behind the ``TrainBackend`` primitives, and the RL step.

``interface`` lists the primitives, ``objectives`` the typed RL objective, ``rl_step`` the one step that applies
the objective through any backend's primitives.
"""

from miles_ray.backends.interface import CriticBackend, LogprobModel, StepPrimitives, TrainBackend
from miles_ray.backends.objectives import (
    AdvantageConfig,
    GAEAdvantageConfig,
    GRPOAdvantageConfig,
    GSPOLossConfig,
    LossConfig,
    ObjectiveConfig,
    PPOClipLossConfig,
    ReinforcePPAdvantageConfig,
    RLOOAdvantageConfig,
    compute_advantages,
    gae_targets,
    resolve_loss,
)
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import MicroBatchConfig, PackingConfig
from miles_ray.backends.rl_step import RLStep
from miles_ray.backends.torch_parallel import TorchBackendConfig

__all__ = [
    "AdvantageConfig",
    "CriticBackend",
    "GAEAdvantageConfig",
    "GRPOAdvantageConfig",
    "GSPOLossConfig",
    "LogprobModel",
    "LossConfig",
    "MicroBatchConfig",
    "ObjectiveConfig",
    "OptimizerConfig",
    "PackingConfig",
    "PPOClipLossConfig",
    "RLOOAdvantageConfig",
    "RLStep",
    "ReinforcePPAdvantageConfig",
    "StepPrimitives",
    "TorchBackendConfig",
    "TrainBackend",
    "compute_advantages",
    "gae_targets",
    "resolve_loss",
]
