"""Training backends behind the ``TrainBackend`` interface (PyTorch FSDP2/DDP; Megatron-core is lazy)."""

from miles_ray.backends.base import OptimizerConfig, PPOClipLossConfig, TorchBackendConfig, TrainBackend

__all__ = ["OptimizerConfig", "PPOClipLossConfig", "TorchBackendConfig", "TrainBackend"]
