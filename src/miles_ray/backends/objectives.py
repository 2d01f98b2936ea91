"""The RL objective as typed config: ``ObjectiveConfig`` and its parts (losses, advantage estimators, KL, shaping).

``TrainerGroupConfig`` is an ``ObjectiveConfig`` plus the model, ranks, backend and optimizer:
``TrainerGroupConfig(advantage={"kind": "rloo"}, loss={"kind": "gspo"})`` picks the pure functions in
``miles_ray.algo``; ``resolve_loss`` and ``compute_advantages`` are the only places that map configs to them, and
``backends.rl_step.RLStep`` is the one place that applies them.

Usage::

    fn, kwargs = resolve_loss(PPOClipLossConfig(clip_high=0.28))
    loss, metrics = fn(logprobs, old_logprobs, advantages, mask, **kwargs)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from miles_ray.algo import (
    gae_advantages,
    gspo_loss,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    terminal_rewards,
    whiten,
)
from miles_ray.algo.advantages import grpo_advantages
from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig, kind_union


class PPOClipLossConfig(StrictConfig):
    """PPO/GRPO clipped policy loss (DAPO clip-higher when ``clip_high > clip_low``; optional dual clip)."""

    kind: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, gt=0.0, lt=1.0, description="Ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(0.2, gt=0.0, le=10.0, description="Ratio upper bound is 1 + clip_high (DAPO: > low).")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="How per-token losses are reduced over the global batch."
    )
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c > 1 for negative advantages.")

    @property
    def normalizer(self) -> Literal["tokens", "sequences"]:
        """What the global batch loss is averaged over."""
        return "tokens" if self.aggregation == "token_mean" else "sequences"


class GSPOLossConfig(StrictConfig):
    """GSPO: clipping on the length-normalised sequence ratio."""

    kind: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, gt=0.0, lt=1.0, description="Sequence ratio lower bound is 1 - clip_low.")
    clip_high: float = Field(4e-4, gt=0.0, le=10.0, description="Sequence ratio upper bound is 1 + clip_high.")

    @property
    def normalizer(self) -> Literal["tokens", "sequences"]:
        """What the global batch loss is averaged over."""
        return "sequences"


class MismatchCorrectionConfig(StrictConfig):
    """Train/rollout mismatch correction with the engine's logprobs (PPO-clip only: it is per token)."""

    kind: Literal["tis", "mis"] = Field("tis", description="tis: truncate the IS ratio; mis: drop outliers.")
    cap: float = Field(2.0, gt=1.0, le=100.0, description="Ratio bound (tis: max weight; mis: [1/cap, cap]).")


class CustomLossConfig(StrictConfig):
    """A user policy loss: ``fn(logprobs, old_logprobs, advantages, mask, **kwargs) -> (loss, metrics)``.

    Shapes as ``algo.losses.ppo_clip_loss``: ``[B, T]`` tensors, ``advantages`` ``[B]`` or ``[B, T]``; ``loss``
    is a scalar tensor averaged over this micro-batch's ``normalizer`` units (the backend re-weights it to
    the global batch), ``metrics`` a dict of floats (token-weighted means are logged as ``m/<name>``).
    """

    kind: Literal["custom"] = "custom"
    fn: str | Callable[..., Any] = Field(..., description="The loss: a callable or an import path 'pkg.mod:fn'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to fn.")
    normalizer: Literal["tokens", "sequences"] = Field(
        "tokens", description="What fn averages over: tokens (token mean) or sequences."
    )

    @model_validator(mode="after")
    def _resolvable(self) -> CustomLossConfig:
        resolve_callable(self.fn, "loss.fn")  # fail where the config is made
        return self


LossConfig = kind_union(PPOClipLossConfig, GSPOLossConfig, CustomLossConfig, default="ppo_clip")


def resolve_loss(config: PPOClipLossConfig | GSPOLossConfig | CustomLossConfig) -> tuple[Callable, dict]:
    """The loss function a config selects and the keyword arguments to call it with."""
    if config.kind == "custom":
        return _checked(resolve_callable(config.fn, "loss.fn")), dict(config.kwargs)
    fn = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss}[config.kind]
    return fn, config.model_dump(exclude={"kind"})


def _checked(fn: Callable) -> Callable:
    """Wrap a user loss so a wrong return type fails with a message naming the contract."""

    def loss(*args, **kwargs):
        out = fn(*args, **kwargs)
        ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and out[0].ndim == 0
        if not ok or not isinstance(out[1], dict):
            raise TypeError(f"loss.fn {fn!r} must return (scalar tensor, dict of floats), got {type(out).__name__}")
        return out

    return loss


class GRPOAdvantageConfig(StrictConfig):
    """Group-relative advantages (``normalize_std=False`` is Dr.GRPO)."""

    kind: Literal["grpo"] = "grpo"
    normalize_std: bool = Field(True, description="Divide by the group's reward std.")


class RLOOAdvantageConfig(StrictConfig):
    """Leave-one-out baseline within each group."""

    kind: Literal["rloo"] = "rloo"


class ReinforcePPAdvantageConfig(StrictConfig):
    """REINFORCE++: batch-normalised returns; ``group_baseline`` subtracts the group mean first."""

    kind: Literal["reinforce_pp"] = "reinforce_pp"
    group_baseline: bool = Field(False, description="Subtract the group mean reward before normalising.")


class GAEAdvantageConfig(StrictConfig):
    """PPO: generalised advantage estimation from a critic's values (needs a ``CriticGroup``).

    The scalar reward sits on each sample's last trained token; with ``TrainerGroupConfig.kl`` in reward
    mode, the per-token k1 KL penalty is added on every token (InstructGPT-style).
    """

    kind: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount per token.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (1: Monte-Carlo returns, 0: one-step TD).")
    whiten: bool = Field(True, description="Normalise advantages over the batch's tokens (returns are not).")


AdvantageConfig = kind_union(
    GRPOAdvantageConfig, RLOOAdvantageConfig, ReinforcePPAdvantageConfig, GAEAdvantageConfig, default="grpo"
)


class KLConfig(StrictConfig):
    """KL to a frozen reference model (the initial weights), as a loss term or as a reward penalty.

    ``loss``: ``coef * aggregate(kl_estimate(policy, ref))`` joins the policy loss (GRPO's k3 term).
    ``reward``: ``coef * sum_t (log pi - log ref)`` (k1, the sequence KL) is subtracted from each sample's
    reward before advantages (InstructGPT/PPO-style). The reference lives on the trainer ranks (same
    placement, sharded like the policy under FSDP2, no gradients).
    """

    coef: float = Field(..., ge=0.0, le=100.0, description="KL coefficient beta.")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (loss mode).")
    mode: Literal["loss", "reward"] = Field("loss", description="KL as a loss term or as a reward penalty.")


class OverlongPenaltyConfig(StrictConfig):
    """DAPO soft overlong punishment added to rewards before advantages (``algo.shaping.overlong_penalty``)."""

    max_len: int = Field(..., ge=1, description="Response length budget L_max in tokens.")
    buffer_len: int = Field(..., ge=1, description="Soft zone before max_len where the penalty grows linearly.")
    penalty_factor: float = Field(1.0, ge=0.0, le=100.0, description="Penalty at and beyond max_len.")

    @model_validator(mode="after")
    def _check(self) -> OverlongPenaltyConfig:
        if self.buffer_len > self.max_len:
            raise ValueError(f"buffer_len ({self.buffer_len}) must be <= max_len ({self.max_len})")
        return self


def compute_advantages(
    config: GRPOAdvantageConfig | RLOOAdvantageConfig | ReinforcePPAdvantageConfig | GAEAdvantageConfig,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Advantages for a batch: ``[B]`` (GRPO, RLOO) or ``[B, T]`` token advantages (REINFORCE++).

    Args:
        config: the selected estimator.
        rewards: ``[B]``.
        group_ids: ``[B]``.
        response_mask: ``[B, T]``.

    """
    if config.kind == "gae":
        raise ValueError("advantage.kind='gae' needs critic values: use gae_targets (TrainerGroup(critic=...))")
    if config.kind == "grpo":
        return grpo_advantages(rewards, group_ids, normalize_std=config.normalize_std)
    if config.kind == "rloo":
        return rloo_advantages(rewards, group_ids)
    return reinforce_pp_advantages(rewards, response_mask, group_ids if config.group_baseline else None)


def gae_targets(
    config: GAEAdvantageConfig,
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    token_penalty: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO advantages and critic targets for a batch.

    Args:
        config: GAE settings.
        rewards: ``[B]`` scalar rewards, put on each sample's last trained token.
        values: ``[B, T]`` critic values on the ``response_mask`` alignment.
        response_mask: ``[B, T]``.
        token_penalty: optional ``[B, T]`` subtracted from the per-token rewards (KL in reward mode).

    Returns:
        ``(advantages, returns)``, ``[B, T]``; advantages whitened if ``config.whiten``, returns never.

    """
    token_rewards = terminal_rewards(rewards, response_mask)
    if token_penalty is not None:
        token_rewards = token_rewards - token_penalty * response_mask
    adv, returns = gae_advantages(token_rewards, values, response_mask, config.gamma, config.lam)
    return (whiten(adv, response_mask) if config.whiten else adv), returns


class ObjectiveConfig(StrictConfig):
    """What one RL step optimises: loss, advantages, their extra terms, reward shaping (``RLStep`` applies it)."""

    loss: LossConfig = Field(default_factory=PPOClipLossConfig, description="Policy loss (ppo_clip | gspo | custom).")
    advantage: AdvantageConfig = Field(
        default_factory=GRPOAdvantageConfig,
        description="Advantage estimator (grpo | rloo | reinforce_pp | gae; gae needs TrainerGroup(critic=...)).",
    )
    mismatch_correction: MismatchCorrectionConfig | None = Field(
        None, description="TIS/MIS weights from the engine's logprobs (ppo_clip loss only); None disables."
    )
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0, description="Entropy bonus coefficient (0: logged only).")
    kl: KLConfig | None = Field(
        None, description="KL to a frozen reference model (the initial weights), as loss or reward; None disables."
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="DAPO soft overlong penalty added to rewards before advantages; None disables."
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Rollout sampling temperature; the trainer's logits are divided by it."
    )
    old_logprobs: Literal["current", "rollout"] = Field(
        "current",
        description="Behaviour logprobs in the PPO ratio: the current policy's (exact for one step per batch) or "
        "the engine's rollout logprobs.",
    )

    @model_validator(mode="after")
    def _check_correction(self) -> ObjectiveConfig:
        if self.mismatch_correction is not None and self.loss.kind != "ppo_clip":
            raise ValueError(
                f"mismatch_correction needs loss.kind='ppo_clip' (per-token weights), got loss.kind={self.loss.kind!r}"
            )
        return self
