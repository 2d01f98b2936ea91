"""Train/rollout mismatch: importance weights that correct for the engine sampling from slightly other numerics.

The engine's logprobs (``rollout_logprobs``) and the trainer's (``train_logprobs``, same weights) differ by
kernel and precision. Truncated importance sampling (TIS) multiplies the per-token loss by
``min(exp(train - rollout), cap)``; masked IS (MIS) drops tokens whose ratio leaves ``[1/cap, cap]`` instead.

Usage::

    w, metrics = importance_weights(train_lp, rollout_lp, mask, mode="tis", cap=2.0)
    loss = masked_aggregate(per_token_loss * w, mask)
"""

from __future__ import annotations

from typing import Literal

import torch


def importance_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["tis", "mis"] = "tis",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token importance weights (no grad) and mismatch metrics.

    Args:
        train_logprobs: ``[B, T]`` trainer logprobs.
        rollout_logprobs: ``[B, T]`` engine logprobs of the same tokens.
        mask: ``[B, T]`` 1 on trained tokens.
        mode: ``tis`` (truncate at ``cap``) or ``mis`` (zero outside ``[1/cap, cap]``).
        cap: truncation bound, > 1.

    Returns:
        ``(weights [B, T], metrics)`` with ``mismatch_abs_mean``, ``mismatch_abs_max``, ``ratio_mean``,
        ``ratio_max`` and ``weight_clipped_frac`` over masked tokens.

    Raises:
        ValueError: for ``cap <= 1`` or an unknown mode.

    """
    if cap <= 1.0:
        raise ValueError(f"cap must be > 1, got {cap}")
    with torch.no_grad():
        diff = train_logprobs.detach() - rollout_logprobs
        ratio = diff.exp()
        if mode == "tis":
            weights = ratio.clamp(max=cap)
            clipped = ratio > cap
        elif mode == "mis":
            clipped = (ratio > cap) | (ratio < 1.0 / cap)
            weights = torch.where(clipped, torch.zeros_like(ratio), ratio)
        else:
            raise ValueError(f"mode must be 'tis' or 'mis', got {mode!r}")
        m = mask.bool()
        num = m.sum().clamp(min=1)
        sel = diff[m]
        metrics = {
            "mismatch_abs_mean": float(sel.abs().sum() / num),
            "mismatch_abs_max": float(sel.abs().max()) if sel.numel() else 0.0,
            "ratio_mean": float(ratio[m].sum() / num),
            "ratio_max": float(ratio[m].max()) if sel.numel() else 0.0,
            "weight_clipped_frac": float(clipped[m].sum() / num),
        }
    return weights * mask, metrics
