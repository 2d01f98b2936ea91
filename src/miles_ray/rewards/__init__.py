"""Reward functions and verifiable tasks."""

from miles_ray.rewards.reasoning_gym import (
    ReasoningGymTask,
    ReasoningGymTaskConfig,
    extract_answer,
    one_digit_arithmetic,
)

__all__ = ["ReasoningGymTask", "ReasoningGymTaskConfig", "extract_answer", "one_digit_arithmetic"]
