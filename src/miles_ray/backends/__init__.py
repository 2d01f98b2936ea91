"""Training backends behind the ``TrainBackend`` interface, and the typed RL objective (advantage + loss)."""

from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig, TrainBackend
from miles_ray.backends.objectives import (
    AdvantageConfig,
    GAEAdvantageConfig,
    GRPOAdvantageConfig,
    GSPOLossConfig,
    LossConfig,
    PPOClipLossConfig,
    ReinforcePPAdvantageConfig,
    RLOOAdvantageConfig,
    compute_advantages,
    gae_targets,
    resolve_loss,
)

__all__ = [
    "AdvantageConfig",
    "GAEAdvantageConfig",
    "GRPOAdvantageConfig",
    "GSPOLossConfig",
    "LossConfig",
    "OptimizerConfig",
    "PPOClipLossConfig",
    "RLOOAdvantageConfig",
    "ReinforcePPAdvantageConfig",
    "TorchBackendConfig",
    "TrainBackend",
    "compute_advantages",
    "gae_targets",
    "resolve_loss",
]
