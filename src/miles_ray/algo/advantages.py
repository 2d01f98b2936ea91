"""Advantage estimators: pure functions of tensors.

``grpo_advantages`` normalises each sample's reward within its group (the n responses to one prompt):
``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; with ``normalize_std=False`` it is Dr.GRPO's
``r_i - mean(r_group)``.

Usage::

    adv = grpo_advantages(rewards, group_ids)          # rewards: [B], group_ids: [B] -> [B]
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: ``[B]`` scalar rewards.
        group_ids: ``[B]`` integer group of each sample; groups need not be contiguous.
        normalize_std: divide by the group's (unbiased) standard deviation; ``False`` gives Dr.GRPO.
        eps: added to the std so a zero-variance group gets zero advantages, not NaN.

    Returns:
        ``[B]`` advantages, float32.

    Raises:
        ValueError: if the shapes differ.

    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    rewards = rewards.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    if not normalize_std:
        return centered
    sq = torch.zeros(num_groups).index_add_(0, inverse, centered**2)
    # unbiased std like torch.std; a group of one sample has no spread
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return centered / (std[inverse] + eps)
