"""``OptimizerConfig``: the AdamW settings every trained model takes (torch and Megatron backends, the critic)."""

from __future__ import annotations

from pydantic import Field, model_validator

from miles_ray.config import StrictConfig


class OptimizerConfig(StrictConfig):
    """AdamW settings."""

    lr: float = Field(1e-6, gt=0.0, le=1.0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global grad norm; 0 disables clipping.")

    @model_validator(mode="after")
    def _check_betas(self) -> OptimizerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        return self
