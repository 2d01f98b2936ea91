"""The RL step: reward shaping, advantages, the per-micro-batch loss and the metrics, driving a backend's primitives.

Every trainer rank runs one step per batch; every backend (torch, Megatron) runs the same one::

    prepare(batch)                         whole batch, identical on every rank
      rewards += overlong penalty          DAPO soft overlong punishment
      rewards -= beta * KL(policy || ref)  KL in reward mode: each rank scores its shard, shards are gathered
      advantages                           GRPO / RLOO / REINFORCE++ from rewards, or GAE from critic values
    update(shard)                          this rank's shard
      backend.forward_backward(micro-batches, loss):  in turn, gradients reduced after the last (a pipeline: 1F1B)
        logprobs, entropy = forward        (MoE: routes compared or replayed, backward included)
        loss = policy loss (TIS/MIS token weights) + beta * KL (loss mode) - entropy bonus
        backward(loss, its share of the global batch's tokens or sequences)
      clip the global grad norm, step      skipped on every rank if anything is not finite
      metrics: sums over ranks, normalised by tokens

Loss normalisation is global: each micro-batch's loss is weighted by its share of the global batch's tokens (or
sequences), so the update equals the one a single rank would make on the whole batch, whatever the micro-batch
size or rank count. PPO's critic takes the same shape of step on the value loss (``value_update``).

Usage (on a rank whose backend is built)::

    step = RLStep(backend, ObjectiveConfig(loss={"kind": "ppo_clip", "clip_high": 0.28}))
    returns, batch_metrics = step.prepare(batch, samples)
    metrics = step.update(batch.shard(backend.dp_rank, backend.dp_size)) | batch_metrics
"""

from __future__ import annotations

import functools

import torch

from miles_ray.algo import importance_weights, kl_estimate, masked_aggregate
from miles_ray.algo.losses import value_loss
from miles_ray.algo.shaping import overlong_penalty
from miles_ray.backends.interface import CriticBackend, LogprobModel, TrainBackend
from miles_ray.backends.objectives import ObjectiveConfig, compute_advantages, gae_targets, resolve_loss
from miles_ray.types import RolloutBatch, Sample


@torch.no_grad()
def logprobs(model: LogprobModel, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """``[B, T-1]`` logprobs of ``batch`` under ``model``'s current weights, fp32 on CPU, micro-batch by micro-batch."""
    model.train(False)
    out = torch.zeros(batch.response_mask.shape)
    for rows in model.micro_batches(batch):
        mb = batch.select(rows)
        with model.micro_batch(mb):
            out[rows] = model.forward_logprobs(mb, temperature)[0].cpu()
    return out


class RLStep:
    """The policy's step on one rank (see the module docstring); ``objective`` is validated by its config."""

    def __init__(self, backend: TrainBackend, objective: ObjectiveConfig):
        self.backend = backend
        self.objective = objective
        self.loss_fn, self.loss_kwargs = resolve_loss(objective.loss)
        # the KL and entropy terms are reduced in the same units as the policy loss
        self.per_token = objective.loss.normalizer == "tokens"
        self.term_mode = "token_mean" if self.per_token else "seq_mean_token_mean"

    # --- 1. rewards and advantages, on the whole batch ---------------------------------------------------------------
    def prepare(
        self,
        batch: RolloutBatch,
        samples: list[Sample],
        values: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Shape ``batch.rewards`` and fill ``batch.advantages`` in place (every rank, the same whole batch).

        Args:
            batch: the whole batch (``RolloutBatch.from_samples(samples)``).
            samples: its samples (response lengths and group ids).
            values: ``[B, T-1]`` critic values, for GAE.
            ref_logprobs: ``[B, T-1]`` reference logprobs from a ``ReferenceGroup`` (else the on-rank reference).

        Returns:
            ``(returns, metrics)``: GAE's ``[B, T-1]`` value targets (None without GAE) and batch-level metrics.

        """
        o = self.objective
        if o.overlong_penalty is not None:
            c = o.overlong_penalty
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            batch.rewards = batch.rewards + overlong_penalty(lengths, c.max_len, c.buffer_len, c.penalty_factor)
        penalty = None  # [B, T-1] per-token KL penalty (reward mode)
        if o.kl is not None and o.kl.mode == "reward":
            kl = self.backend.gather_shards(self.token_kl(batch, ref_logprobs))[: batch.num_samples]  # no filler
            penalty = o.kl.coef * kl
        returns = None
        if o.advantage.kind == "gae":
            if values is None:
                raise ValueError("advantage.kind='gae' needs the critic's values (TrainerGroup(critic=...))")
            batch.advantages, returns = gae_targets(o.advantage, batch.rewards, values, batch.response_mask, penalty)
        else:
            if penalty is not None:
                batch.rewards = batch.rewards - penalty.sum(-1)
            self.advantages(batch, samples)
        adv = batch.advantages.abs()  # [B], or [B, T-1] token advantages: mean over trained tokens
        mask = batch.response_mask
        metrics = {
            "advantage_abs_mean": float(adv.mean() if adv.ndim == 1 else (adv * mask).sum() / mask.sum()),
            "shaped_reward_mean": float(batch.rewards.mean()),
        }
        if penalty is not None:
            metrics["kl_reward_penalty_mean"] = float(penalty.sum(-1).mean())
        return returns, metrics

    def advantages(self, batch: RolloutBatch, samples: list[Sample]) -> None:
        """Fill ``batch.advantages`` from its rewards with the configured estimator (not GAE: that needs values)."""
        group_ids = torch.tensor([s.group_id for s in samples])
        batch.advantages = compute_advantages(self.objective.advantage, batch.rewards, group_ids, batch.response_mask)

    def token_kl(self, batch: RolloutBatch, ref_logprobs: torch.Tensor | None = None) -> torch.Tensor:
        """The k1 KL ``log pi - log ref`` on this rank's shard of ``batch``: ``[b, T-1]``, trained tokens, no grad.

        ``ref_logprobs`` (``[B, T-1]`` of the whole batch, from a reference actor) replaces the on-rank reference.

        Raises:
            RuntimeError: with neither ``ref_logprobs`` nor a reference on this rank.

        """
        dp = (self.backend.dp_rank, self.backend.dp_size)
        shard, temperature = batch.shard(*dp), self.objective.temperature
        if ref_logprobs is not None:
            ref = RolloutBatch.shard_rows(ref_logprobs, *dp)
        elif self.backend.reference is not None:
            ref = logprobs(self.backend.reference, shard, temperature)
        else:
            raise RuntimeError("no reference model on this rank: set TrainerGroupConfig.kl (without a ReferenceGroup)")
        return (logprobs(self.backend, shard, temperature) - ref) * shard.response_mask

    # --- 2. the update, on this rank's shard -----------------------------------------------------------------------
    def update(self, shard: RolloutBatch, ref_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on this rank's shard (advantages filled); metrics summed over the ranks.

        Args:
            shard: this rank's samples (``RolloutBatch.shard``).
            ref_logprobs: ``[b, T-1]`` reference logprobs of the shard for KL in loss mode (from a
                ``ReferenceGroup``); None uses the on-rank reference.

        Returns:
            Metrics over the global batch (token-weighted where per token).

        """
        b = self.backend
        b.train(True)
        local_units = float(shard.response_mask.sum()) if self.per_token else float(shard.num_real)
        total_units = b.global_sum([local_units])[0]
        b.route_counts()  # count this step's forwards only
        rows = b.micro_batches(shard)
        mbs = [shard.select(r) for r in rows]
        # every reference logprob first: a LoRA reference switches the policy's adapters off while it runs
        given = [None if ref_logprobs is None else ref_logprobs[r] for r in rows]
        refs = [self._reference_logprobs(mb, ref) for mb, ref in zip(mbs, given)]
        stats = b.forward_backward(mbs, self.objective.temperature, functools.partial(self._loss, refs), total_units)
        lp_diff_max = max((s.pop("lp_diff_max") for s in stats), default=0.0)
        sums: dict[str, float] = dict.fromkeys(_SUMS, 0.0)
        for s in stats:
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + v
        counts = b.route_counts()
        if counts is not None:
            sums["route_differ"], sums["route_recorded"] = counts
        grad_norm, skipped = b.clip_and_step(sums["loss"])
        return self._metrics(sums, local_units, b.global_max(lp_diff_max), grad_norm, skipped, counts is not None)

    def _loss(
        self, refs: list[torch.Tensor | None], i: int, mb: RolloutBatch, lp: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, float, dict[str, float]]:
        """Micro-batch ``i``'s loss from its logprobs and entropies (the backend runs forward and backward).

        Returns:
            ``(loss, units, stats)``: the loss, its units (tokens or sequences) and its sums (``_SUMS``, the loss's
            own metrics as ``m/<name>``) with its largest |train - rollout| logprob difference (``lp_diff_max``).

        """
        o = self.objective
        mask = mb.response_mask.to(lp.device)
        tokens = float(mask.sum())
        stats = dict.fromkeys(_SUMS, 0.0)
        rollout = mb.rollout_logprobs.to(lp.device)
        old = rollout if o.old_logprobs == "rollout" else lp.detach()
        extra = {}
        if o.mismatch_correction is not None:
            c = o.mismatch_correction
            extra["token_weights"], wm = importance_weights(lp, rollout, mask, c.kind, c.cap)
            stats["clipped_tokens"] = wm["weight_clipped_frac"] * tokens
        loss, m = self.loss_fn(lp, old, mb.advantages.to(lp.device), mask, **self.loss_kwargs, **extra)
        if refs[i] is not None:
            kl_tokens = kl_estimate(lp, refs[i], o.kl.estimator)
            loss = loss + o.kl.coef * masked_aggregate(kl_tokens, mask, self.term_mode)
            stats["ref_kl_sum"] = float((kl_tokens.detach() * mask).sum())
        if o.entropy_coef > 0:  # entropy bonus: maximise entropy, so subtract it from the loss
            loss = loss - o.entropy_coef * masked_aggregate(entropy, mask, self.term_mode)
        units = tokens if self.per_token else float(mask.shape[0])
        stats["loss"] = float(loss.detach()) * units
        stats.update({f"m/{k}": v * tokens for k, v in m.items()})  # the loss's own metrics, token-weighted
        with torch.no_grad():
            diff = (lp - rollout).abs() * mask
            log_ratio = rollout - lp  # k3 estimate of KL(rollout || train)
            stats["k3_sum"] = float(((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum())
            stats["lp_diff_sum"] = float(diff.sum())
            stats["entropy_sum"] = float((entropy * mask).sum())
        stats["tokens"] = tokens
        stats["lp_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        return loss, units, stats

    def _reference_logprobs(self, mb: RolloutBatch, ref: torch.Tensor | None) -> torch.Tensor | None:
        """KL in loss mode: the micro-batch's reference logprobs (given, or from the on-rank reference); else None."""
        kl = self.objective.kl
        if kl is None or kl.mode != "loss":
            return None
        if ref is not None:
            return ref.to(self.backend.device)
        if self.backend.reference is None:
            raise RuntimeError("KL in loss mode needs reference logprobs: a ReferenceGroup or an on-rank reference")
        with torch.no_grad():
            return self.backend.reference.forward_logprobs(mb, self.objective.temperature)[0]

    def _metrics(self, sums: dict, local_units: float, lp_diff_max: float, grad_norm: float, skipped: bool, moe: bool):
        """The step's metrics from this rank's ``sums``, summed over the ranks (one all-reduce)."""
        r = dict(zip([*sums, "units"], self.backend.global_sum([*sums.values(), local_units])))
        tokens = max(r["tokens"], 1.0)
        return {
            **{k[2:]: v / tokens for k, v in r.items() if k.startswith("m/")},
            "loss": r["loss"] / max(r["units"], 1.0),
            "grad_norm": grad_norm,
            "step_skipped": float(skipped),
            "train_rollout_logprob_abs_diff_mean": r["lp_diff_sum"] / tokens,
            "train_rollout_logprob_abs_diff_max": lp_diff_max,
            "train_rollout_k3_kl": r["k3_sum"] / tokens,
            "entropy": r["entropy_sum"] / tokens,
            "is_weight_clipped_frac": r["clipped_tokens"] / tokens,
            "ref_kl": r["ref_kl_sum"] / tokens,
            "num_tokens": r["tokens"],
            # MoE: share of (token, layer) expert sets the trainer's own routers choose unlike the rollout's
            **({"moe_route_mismatch_frac": r["route_differ"] / max(r["route_recorded"], 1.0)} if moe else {}),
        }


# what a policy step sums per rank (the loss's own metrics join as "m/<name>")
_SUMS = ("loss", "lp_diff_sum", "k3_sum", "tokens", "entropy_sum", "clipped_tokens", "ref_kl_sum")
_SUMS += ("route_differ", "route_recorded")


# --- PPO's critic: the same shape of step on the value loss -------------------------------------------------------
@torch.no_grad()
def critic_values(critic: CriticBackend, batch: RolloutBatch) -> torch.Tensor:
    """``[B, T-1]`` values of ``batch``, 0 off the response mask, fp32 on CPU."""
    critic.train(False)
    out = torch.zeros(batch.response_mask.shape)
    for rows in critic.micro_batches(batch):
        out[rows] = critic.forward_values(batch.select(rows)).cpu()
    return out * batch.response_mask


def value_update(
    critic: CriticBackend,
    shard: RolloutBatch,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float | None,
) -> dict[str, float]:
    """One optimizer step of the critic on the (clipped) value loss over this rank's shard, token-normalised globally.

    Args:
        critic: this rank's critic.
        shard: this rank's samples.
        old_values: ``[b, T-1]`` values the returns were computed with.
        returns: ``[b, T-1]`` GAE returns (value targets).
        value_clip: PPO value clipping around ``old_values``; None disables.

    """
    critic.train(True)
    total_tokens = critic.global_sum([float(shard.response_mask.sum())])[0]
    sums = {"loss": 0.0, "tokens": 0.0, "value_clipfrac": 0.0}
    batches = critic.micro_batches(shard)
    for i, rows in enumerate(batches):
        critic.grad_sync(i == len(batches) - 1)
        mb = shard.select(rows)
        mask = mb.response_mask.to(critic.device)
        tokens = float(mask.sum())
        old = old_values[rows].to(critic.device)
        target = returns[rows].to(critic.device)
        loss, m = value_loss(critic.forward_values(mb), old, target, mask, value_clip)
        critic.backward(loss, tokens, total_tokens)
        sums["loss"] += float(loss.detach()) * tokens
        sums["value_clipfrac"] += m["value_clipfrac"] * tokens
        sums["tokens"] += tokens
    grad_norm, skipped = critic.clip_and_step(sums["loss"])
    r = dict(zip(sums, critic.global_sum(list(sums.values()))))
    tokens = max(r["tokens"], 1.0)
    return {
        "value_loss": r["loss"] / tokens,
        "value_clipfrac": r["value_clipfrac"] / tokens,
        "grad_norm": grad_norm,
        "step_skipped": float(skipped),
        "num_tokens": r["tokens"],
    }
