"""DAPO pieces: the soft overlong penalty (reward shaping) and the zero-variance group filter (dynamic sampling).

Both are pure functions of tensors. ``overlong_penalty`` is added to rewards before advantages;
``has_reward_variance`` tells dynamic sampling which groups carry a learning signal (a group whose
samples all got the same reward has all-zero GRPO advantages and only dilutes the batch).

Usage::

    rewards = rewards + overlong_penalty(lengths, max_len=512, buffer_len=64)
    keep = has_reward_variance(rewards, group_ids)       # [B] bool, equal within a group
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, per sample.

    ``0`` for ``L <= max_len - buffer_len``; ``(max_len - buffer_len - L) / buffer_len * factor`` inside the
    buffer (linear from 0 to ``-factor``); ``-factor`` beyond ``max_len``.

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_len: the response length budget ``L_max``.
        buffer_len: the soft zone ``L_cache`` before ``max_len`` (``0 < buffer_len <= max_len``).
        penalty_factor: penalty at and beyond ``max_len``.

    Returns:
        ``[B]`` penalties (``<= 0``), float32.

    Raises:
        ValueError: for ``buffer_len`` outside ``(0, max_len]``.

    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    excess = lengths.float() - (max_len - buffer_len)
    return -(excess / buffer_len).clamp(min=0.0, max=1.0) * penalty_factor


def has_reward_variance(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``[B]`` bool: True for samples whose group's rewards are not all equal (``max - min > eps``).

    Args:
        rewards: ``[B]`` scalar rewards.
        group_ids: ``[B]`` group index of each sample.
        eps: tolerance under which rewards count as equal.

    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    hi = torch.full((num_groups,), -torch.inf).scatter_reduce(0, inverse, rewards.float(), "amax")
    lo = torch.full((num_groups,), torch.inf).scatter_reduce(0, inverse, rewards.float(), "amin")
    return (hi - lo > eps)[inverse]
