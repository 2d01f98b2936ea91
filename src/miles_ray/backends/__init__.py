"""Training backends behind the ``TrainBackend`` interface, and the typed RL objective (advantage + loss)."""

from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig, TrainBackend
from miles_ray.backends.objectives import (
    AdvantageConfig,
    GRPOAdvantageConfig,
    GSPOLossConfig,
    LossConfig,
    PPOClipLossConfig,
    ReinforcePPAdvantageConfig,
    RLOOAdvantageConfig,
    compute_advantages,
    resolve_loss,
)

__all__ = [
    "AdvantageConfig",
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
    "resolve_loss",
]
