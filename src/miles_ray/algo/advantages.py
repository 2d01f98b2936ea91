"""Advantage estimators: pure functions of tensors.

``grpo_advantages`` normalises each sample's reward within its group (the n responses to one prompt):
``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``; with ``normalize_std=False`` it is Dr.GRPO's
``r_i - mean(r_group)``.

Usage::

    adv = grpo_advantages(rewards, group_ids)          # rewards: [B], group_ids: [B] -> [B]
"""

from __future__ import annotations

import torch


def _group_sums(rewards: torch.Tensor, group_ids: torch.Tensor):
    """Validate ``[B]`` inputs; return ``(rewards fp32, group index per sample, group sizes, group reward sums)``."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    rewards = rewards.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel()).index_add_(0, inverse, rewards)
    return rewards, inverse, counts, sums


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
    rewards, inverse, counts, sums = _group_sums(rewards, group_ids)
    num_groups = counts.numel()
    means = sums / counts
    centered = rewards - means[inverse]
    if not normalize_std:
        return centered
    sq = torch.zeros(num_groups).index_add_(0, inverse, centered**2)
    # unbiased std like torch.std; a group of one sample has no spread
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return centered / (std[inverse] + eps)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's reward minus the mean reward of the *other* samples of its group.

    ``A_i = r_i - (sum_group - r_i) / (n - 1)``; a group of one sample gets 0.

    Args:
        rewards: ``[B]``.
        group_ids: ``[B]``.

    Returns:
        ``[B]`` advantages.

    """
    rewards, inverse, counts, sums = _group_sums(rewards, group_ids)
    n = counts[inverse].float()
    others = (sums[inverse] - rewards) / (n - 1).clamp(min=1)
    return torch.where(n > 1, rewards - others, torch.zeros_like(rewards))


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (PPO with a critic).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where ``t+1`` is the
    next *masked-in* token and the value after the last token is 0.

    Args:
        rewards: ``[B, T]`` per-token rewards (typically the scalar reward on the last response token).
        values: ``[B, T]`` critic values.
        mask: ``[B, T]`` 1 on response tokens.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and 0 outside the mask; ``returns = advantages + values``.

    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, mask {tuple(mask.shape)} differ"
        )
    mask = mask.float()
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    next_value = torch.zeros(rewards.shape[0])
    next_adv = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        # padding positions pass the next token's value/advantage through unchanged
        next_value = torch.where(m > 0, values[:, t].float(), next_value)
        next_adv = torch.where(m > 0, adv, next_adv)
    return advantages, (advantages + values.float()) * mask


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar reward on its last trained token (the per-token rewards GAE consumes).

    Args:
        rewards: ``[B]``.
        mask: ``[B, T]`` 1 on trained tokens.

    Returns:
        ``[B, T]``, zero except at each row's last masked-in position (all zero for a row with none).

    """
    m = mask > 0
    num_t = mask.shape[1]
    last = num_t - 1 - torch.flip(m, dims=[1]).float().argmax(dim=1)  # last masked-in index per row
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = m.any(dim=1)
    out[has.nonzero()[:, 0], last[has]] = rewards.float()[has]
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``values`` ``[B, T]`` to zero mean, unit std over the masked-in positions (0 elsewhere)."""
    m = mask.float()
    num = m.sum().clamp(min=1.0)
    mean = (values * m).sum() / num
    var = (((values - mean) * m) ** 2).sum() / num
    return (values - mean) / (var.sqrt() + eps) * m


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: per-sample return normalised over the whole batch (no critic, no per-group std).

    With ``group_ids`` it is the baseline variant: the group mean is subtracted first, then the batch is
    normalised. The result is broadcast over each sample's masked tokens.

    Args:
        rewards: ``[B]`` scalar rewards.
        mask: ``[B, T]`` 1 on response tokens.
        group_ids: optional ``[B]``; subtract the group mean before batch normalisation.
        eps: added to the batch std.

    Returns:
        ``[B, T]`` token advantages, 0 outside the mask.

    """
    r = rewards.float()
    if group_ids is not None:
        r = grpo_advantages(r, group_ids, normalize_std=False)
    return whiten(r[:, None] * mask.float(), mask, eps)
