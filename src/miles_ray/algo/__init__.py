"""Pure-torch RL algorithm pieces: advantage estimators, policy losses, KL, mismatch correction (no Ray)."""

from miles_ray.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    terminal_rewards,
    whiten,
)
from miles_ray.algo.correction import importance_weights
from miles_ray.algo.kl import entropy_from_logits, kl_estimate
from miles_ray.algo.losses import gspo_loss, masked_aggregate, ppo_clip_loss, value_loss

__all__ = [
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "masked_aggregate",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "terminal_rewards",
    "value_loss",
    "whiten",
]
