"""Pure-torch RL algorithm pieces: advantage estimators and policy losses (no Ray, no model code)."""

from miles_ray.algo.advantages import grpo_advantages
from miles_ray.algo.losses import masked_aggregate, ppo_clip_loss

__all__ = ["grpo_advantages", "masked_aggregate", "ppo_clip_loss"]
