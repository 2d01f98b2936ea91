"""KL estimators between the policy and a reference, and the entropy of the policy. Pure torch.

With ``log_ratio = logprobs - ref_logprobs`` per token (samples drawn from the policy):
``k1 = log_ratio`` (unbiased, high variance), ``k2 = log_ratio**2 / 2``, ``k3 = exp(-log_ratio) - 1 + log_ratio``
(unbiased, low variance, always >= 0; Schulman's estimator used by GRPO).

Usage::

    kl = kl_estimate(logprobs, ref_logprobs, kind="k3")     # [B, T]
"""

from __future__ import annotations

from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference).

    Args:
        logprobs: ``[B, T]`` policy logprobs of the sampled tokens.
        ref_logprobs: ``[B, T]`` reference logprobs of the same tokens.
        kind: ``k1``, ``k2`` or ``k3``.

    Raises:
        ValueError: for an unknown kind.

    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"kind must be one of k1, k2, k3; got {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: ``[..., V] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
