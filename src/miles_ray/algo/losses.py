"""Policy losses: pure functions of tensors returning ``(loss, metrics)``.

``ppo_clip_loss`` is the clipped surrogate of PPO/GRPO,
``-min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)`` per token, aggregated by ``masked_aggregate``.

Usage::

    loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2)

Shapes: ``B`` samples, ``T`` token positions.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def masked_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: Aggregation = "token_mean") -> torch.Tensor:
    """Reduce per-token ``values`` ``[B, T]`` over the positions where ``mask`` ``[B, T]`` is 1.

    Modes:
        token_mean: sum over all tokens / number of tokens (every token weighs the same; DAPO's choice).
        seq_mean_token_mean: mean over each sequence's tokens, then mean over sequences (original GRPO).
        seq_mean_token_sum: sum over each sequence's tokens, then mean over sequences (Dr.GRPO-style).

    Raises:
        ValueError: for an unknown mode or mismatched shapes.

    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(values.dtype)
    if mode == "token_mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (values * mask).sum(dim=-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(
            f"aggregation must be one of token_mean, seq_mean_token_mean, seq_mean_token_sum; got {mode!r}"
        )
    return per_seq.mean()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: Aggregation = "token_mean",
    dual_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (GRPO's policy loss when advantages are group-relative).

    Args:
        logprobs: ``[B, T]`` current policy log-probabilities of the taken tokens (with grad).
        old_logprobs: ``[B, T]`` log-probabilities under the policy that produced the data (no grad).
        advantages: ``[B]`` per-sample or ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` 1 on trained tokens.
        clip_low: ratio lower bound is ``1 - clip_low``.
        clip_high: ratio upper bound is ``1 + clip_high`` (DAPO clip-higher when larger than clip_low).
        aggregation: how per-token losses are reduced, see ``masked_aggregate``.
        dual_clip: dual-clip constant ``c > 1``: for negative advantages the loss is capped at ``-c * A``
            so a huge ratio on a bad token cannot blow up the update. None disables it.
        token_weights: optional ``[B, T]`` per-token weights (no grad), e.g. TIS importance weights; they
            scale each token's loss without changing the normaliser.

    Returns:
        ``(loss, metrics)`` with metrics ``clipfrac`` (fraction of tokens whose ratio was clipped) and
        ``approx_kl`` (k3 estimate of KL(old || new) on the masked tokens).

    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    loss = masked_aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        m = mask.to(logprobs.dtype)
        num_tokens = m.sum().clamp(min=1.0)
        clipfrac = ((clipped > unclipped).to(m.dtype) * m).sum() / num_tokens
        approx_kl = ((torch.exp(-log_ratio) - 1 + log_ratio) * m).sum() / num_tokens
    return loss, {"clipfrac": float(clipfrac), "approx_kl": float(approx_kl)}


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO clipping on the sequence-level ratio ``exp(mean_t log_ratio_t)`` (length-normalised).

    Gradients flow through every token as ``s_i * sg(...)``: the token-level form of GSPO, which equals the
    sequence objective's gradient.

    Args:
        logprobs: ``[B, T]`` current logprobs (with grad).
        old_logprobs: ``[B, T]`` behaviour logprobs.
        advantages: ``[B]`` sequence advantages.
        mask: ``[B, T]``.
        clip_low: sequence ratio lower bound ``1 - clip_low`` (GSPO uses ~3e-4).
        clip_high: upper bound ``1 + clip_high`` (GSPO uses ~4e-4).

    Returns:
        ``(loss, metrics)``; the loss is the mean over sequences; metrics ``clipfrac`` (of sequences).

    """
    m = mask.to(logprobs.dtype)
    lengths = m.sum(dim=-1).clamp(min=1.0)
    log_ratio = ((logprobs - old_logprobs.detach()) * m).sum(dim=-1) / lengths
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    per_seq = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipfrac = float((clipped > unclipped).float().mean())
    return per_seq.mean(), {"clipfrac": clipfrac, "seq_ratio_mean": float(ratio.detach().mean())}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO critic loss ``0.5 * (V - R)^2``, token mean, optionally clipped around the rollout-time values.

    With ``clip``, ``V`` is also clipped to ``[V_old - clip, V_old + clip]`` and the larger of the two squared
    errors is taken per token (PPO2's value clipping), so one update cannot move a value far from the one
    the advantages were computed with.

    Args:
        values: ``[B, T]`` current critic values.
        old_values: ``[B, T]`` values when the returns were computed.
        returns: ``[B, T]`` value targets (GAE advantages + old values).
        mask: ``[B, T]`` 1 on trained tokens.
        clip: value clip range; None disables clipping.

    Returns:
        ``(loss, {"value_clipfrac", "value_mean", "return_mean"})``.

    Raises:
        ValueError: for mismatched shapes.

    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)}, "
            f"mask {tuple(mask.shape)} differ"
        )
    err = (values - returns) ** 2
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        clipped = err_clip > err
        err = torch.maximum(err, err_clip)
    loss = 0.5 * masked_aggregate(err, mask)
    with torch.no_grad():
        metrics = {
            "value_clipfrac": float(masked_aggregate(clipped.float(), mask)),
            "value_mean": float(masked_aggregate(values.detach(), mask)),
            "return_mean": float(masked_aggregate(returns, mask)),
        }
    return loss, metrics
