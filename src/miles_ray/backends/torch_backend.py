"""PyTorch training backend: HF causal LM, FSDP2 or DDP over a gloo (CPU) / NCCL (GPU) group, AdamW.

Loss normalisation is global: each micro-batch's loss is weighted by its share of the global batch's
tokens (or sequences), and gradients are all-reduced as a sum-scaled mean, so the update equals the
one a single rank would make on the whole batch, whatever the micro-batch size or rank count.

Usage (inside a rank whose ``torch.distributed`` default group is initialised)::

    backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-5), PPOClipLossConfig(), model_path)
    metrics = backend.train_step(batch.shard(rank, world), temperature=1.0)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from miles_ray.algo import importance_weights, kl_estimate, masked_aggregate
from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig
from miles_ray.backends.lora import adapter_tensors, base_tensors, inject_lora, merged_weight, set_adapters_enabled
from miles_ray.backends.objectives import (
    CustomLossConfig,
    GSPOLossConfig,
    KLConfig,
    MismatchCorrectionConfig,
    PPOClipLossConfig,
    resolve_loss,
)
from miles_ray.backends.routing import RouteTracker, find_routers
from miles_ray.backends.torch_rank import TorchRank, param_dtype
from miles_ray.models.quant import apply_weight_format
from miles_ray.sync.plan import Bucket, SyncPlan, plan_buckets
from miles_ray.types import RolloutBatch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each position's distribution.

    Args:
        logits: ``[B, K, V]``.
        targets: ``[B, K]``.
        temperature: logits are divided by it.

    Returns:
        ``(logprobs [B, K], entropy [B, K])``.

    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(-1, targets[..., None])[..., 0], entropy


def load_causal_lm(model_path: str, config: TorchBackendConfig) -> torch.nn.Module:
    """The HF causal LM at ``model_path`` in the config's dtype, without a generation KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=param_dtype(config), attn_implementation="sdpa")
    model.config.use_cache = False
    return model


class PolicyRank(TorchRank):
    """One rank of an HF causal LM that computes token logprobs; frozen (the reference) when ``optim`` is None.

    With ``config.lora`` (trained ranks only) peft adapters are injected before wrapping and only they train. With
    ``config.weight_format`` the linear layers compute through the rollout format (fake-quant, straight-through).
    An MoE policy tracks its routes against the rollout's (``routes``), replaying them with ``config.routing_replay``.
    """

    def __init__(self, config: TorchBackendConfig, optim: OptimizerConfig | None, model_path: str):
        module = load_causal_lm(model_path, config)
        self.adapter = inject_lora(module, config.lora) if config.lora is not None and optim is not None else None
        if config.weight_format is not None:  # every forward sees the engines' rounded weights
            apply_weight_format(module, config.weight_format, "trainer")
        self.routes = None
        if optim is not None and (config.routing_replay or find_routers(module)):
            self.routes = RouteTracker(module, replay=config.routing_replay)
        super().__init__(config, optim, module)

    def tracking_routes(self, batch: RolloutBatch, rows: slice):
        """Context for a forward (and its backward) over ``batch`` rows ``rows``: compare / replay their routes.

        Raises:
            ValueError: with ``routing_replay`` on and a batch that carries no routes.

        """
        if self.routes is None:
            return contextlib.nullcontext()
        if batch.routes is None and self.config.routing_replay:
            raise ValueError(
                "backend.routing_replay is on but the batch carries no routes: the samples must come from embedded "
                "engines serving the MoE model (vLLM engines and multi-turn samples record none)"
            )
        return self.routes.tracking(None if batch.routes is None else batch.routes[rows])

    def forward_logprobs(self, input_ids, attention_mask, response_mask, temperature):
        """``[B, T-1]`` next-token logprobs and entropies, computed only from the first response position on.

        The LM head and log-softmax over the vocabulary dominate a small model's cost; prompt positions
        carry no loss, so their logits are never formed (``logits_to_keep``). Earlier positions are 0.
        """
        input_ids = input_ids.to(self.device)
        width = input_ids.shape[1] - 1
        nonzero = response_mask.any(dim=0).nonzero()
        start = int(nonzero[0]) if nonzero.numel() else width - 1
        keep = torch.arange(start, width, device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask.to(self.device), logits_to_keep=keep)
        lp, entropy = token_logprobs(out.logits, input_ids[:, start + 1 :], temperature)
        pad = lp.new_zeros(lp.shape[0], start)
        return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """``[B, T-1]`` logprobs of this rank's batch under the current weights, fp32 on CPU."""
        self.model.eval()
        mbs = self.config.micro_batch_size
        parts = []
        for i in range(0, batch.num_samples, mbs):
            sl = slice(i, i + mbs)
            with self.tracking_routes(batch, sl):
                lp, _ = self.forward_logprobs(batch.input_ids[sl], batch.attention_mask[sl], batch.response_mask[sl],
                                              temperature)  # fmt: skip
            parts.append(lp.cpu())
        return torch.cat(parts)


class _BaseWeightsReference:
    """A LoRA policy's frozen reference: the same model with its adapters off (the base weights, no second copy)."""

    def __init__(self, policy: PolicyRank):
        self.policy = policy

    def _off(self, fn, *args):
        set_adapters_enabled(self.policy.hf_model, False)
        try:
            return fn(*args)
        finally:
            set_adapters_enabled(self.policy.hf_model, True)

    def forward_logprobs(self, input_ids, attention_mask, response_mask, temperature):
        """As ``PolicyRank.forward_logprobs``, on the base weights."""
        return self._off(self.policy.forward_logprobs, input_ids, attention_mask, response_mask, temperature)

    def compute_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """As ``PolicyRank.compute_logprobs``, on the base weights."""
        return self._off(self.policy.compute_logprobs, batch, temperature)


class TorchBackend(PolicyRank):
    """One data-parallel rank of the policy trained with FSDP2 or DDP.

    With ``kl`` set and ``local_reference``, the frozen reference (the initial weights) is loaded on this
    rank, placed and sharded like the policy (a LoRA policy uses its own base weights, adapters off);
    otherwise reference logprobs come in with each call (from a ``ReferenceGroup`` actor).
    """

    def __init__(
        self,
        config: TorchBackendConfig,
        optim: OptimizerConfig,
        loss: PPOClipLossConfig | GSPOLossConfig | CustomLossConfig,
        model_path: str,
        correction: MismatchCorrectionConfig | None = None,
        entropy_coef: float = 0.0,
        kl: KLConfig | None = None,
        local_reference: bool = True,
    ):
        super().__init__(config, optim, model_path)
        self.set_objectives(loss, correction, entropy_coef, kl)
        self.reference = None
        if kl is not None and local_reference:
            self.reference = _BaseWeightsReference(self) if self.adapter else PolicyRank(config, None, model_path)

    def set_objectives(self, loss, correction: MismatchCorrectionConfig | None, entropy_coef: float, kl) -> None:
        """The loss and its extra terms ``train_step`` applies (shared with the Megatron backend).

        Raises:
            ValueError: for a mismatch correction with a sequence-level loss.

        """
        self.loss_config = loss
        self.loss_fn, self.loss_kwargs = resolve_loss(loss)
        if correction is not None and loss.kind != "ppo_clip":
            raise ValueError(f"mismatch_correction weights tokens; loss kind {loss.kind!r} has a sequence ratio")
        self.correction, self.entropy_coef, self.kl = correction, entropy_coef, kl

    def reference_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """``[B, T-1]`` logprobs under the on-rank reference model."""
        if self.reference is None:
            raise RuntimeError("no reference model on this rank: set TrainerGroupConfig.kl (without a ReferenceGroup)")
        return self.reference.compute_logprobs(batch, temperature)

    def token_kl(self, batch: RolloutBatch, temperature: float, ref_logprobs: torch.Tensor | None = None):
        """``[B, T-1]`` k1 KL ``log pi - log ref`` on each trained token (0 elsewhere), no grad.

        ``ref_logprobs`` (``[B, T-1]``, from a reference actor) replaces the on-rank reference.
        """
        policy = self.compute_logprobs(batch, temperature)
        ref = self.reference_logprobs(batch, temperature) if ref_logprobs is None else ref_logprobs
        return (policy - ref) * batch.response_mask

    def train_step(
        self,
        batch: RolloutBatch,
        temperature: float,
        old_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's shard of the batch.

        Args:
            batch: this rank's samples (``RolloutBatch.shard``), advantages filled.
            temperature: the rollout temperature (logits are divided by it, as the engine did).
            old_logprobs: ``[B, T-1]`` behaviour-policy logprobs; None uses the current policy's
                (detached), exact for one optimizer step per rollout batch.
            ref_logprobs: ``[B, T-1]`` reference logprobs for KL in loss mode (from a ``ReferenceGroup``);
                None uses the on-rank reference.

        Returns:
            Metrics averaged over ranks (token-weighted where per token).

        """
        self.model.train()
        mask_all = batch.response_mask
        per_token = self.loss_config.normalizer == "tokens"
        local_units = float(mask_all.sum()) if per_token else float(batch.num_samples)
        global_units = self.global_sum(local_units)
        mbs = self.config.micro_batch_size
        sums = {
            "loss": 0.0,
            "lp_diff_sum": 0.0,
            "k3_sum": 0.0,
            "tokens": 0.0,
            "entropy_sum": 0.0,
            "clipped_tokens": 0.0,
            "ref_kl_sum": 0.0,
            "route_differ": 0.0,
            "route_recorded": 0.0,
        }
        if self.routes is not None:
            self.routes.take_mismatch()  # count this step's forwards only
        lp_diff_max = 0.0
        starts = list(range(0, batch.num_samples, mbs))
        for i in starts:
            sl = slice(i, i + mbs)
            self.grad_sync(i == starts[-1])  # reduce gradients once, after the last micro-batch
            mask = mask_all[sl].to(self.device)
            tokens = float(mask.sum())
            ref_lp = None
            if self.kl is not None and self.kl.mode == "loss":
                if ref_logprobs is not None:
                    ref_lp = ref_logprobs[sl].to(self.device)
                else:  # before the policy forward: a LoRA reference switches the adapters off and on again
                    with torch.no_grad():
                        ref_lp, _ = self.reference.forward_logprobs(
                            batch.input_ids[sl], batch.attention_mask[sl], mask_all[sl], temperature
                        )
            with self.tracking_routes(batch, sl):  # the backward too: checkpointing re-runs the routers
                logprobs, entropy = self.forward_logprobs(
                    batch.input_ids[sl], batch.attention_mask[sl], mask_all[sl], temperature
                )
                old = logprobs.detach() if old_logprobs is None else old_logprobs[sl].to(self.device)
                adv = batch.advantages[sl].to(self.device)
                rollout = batch.rollout_logprobs[sl].to(self.device)
                extra = {}
                if self.correction is not None:
                    weights, wm = importance_weights(logprobs, rollout, mask, self.correction.kind, self.correction.cap)
                    extra["token_weights"] = weights
                    sums["clipped_tokens"] += wm["weight_clipped_frac"] * tokens
                loss, m = self.loss_fn(logprobs, old, adv, mask, **self.loss_kwargs, **extra)
                if ref_lp is not None:
                    kl_tokens = kl_estimate(logprobs, ref_lp, self.kl.estimator)
                    mode = "token_mean" if per_token else "seq_mean_token_mean"  # same units as the policy loss
                    loss = loss + self.kl.coef * masked_aggregate(kl_tokens, mask, mode)
                    sums["ref_kl_sum"] += float((kl_tokens.detach() * mask).sum())
                if self.entropy_coef > 0:  # entropy bonus: maximise entropy, so subtract it from the loss
                    mode = "token_mean" if per_token else "seq_mean_token_mean"  # same units as the policy loss
                    loss = loss - self.entropy_coef * masked_aggregate(entropy, mask, mode)
                units = tokens if per_token else float(mask.shape[0])
                self.backward_share(loss, units, global_units)
            sums["loss"] += float(loss.detach()) * units
            for k, v in m.items():  # the loss's own metrics, token-weighted
                sums[f"m/{k}"] = sums.get(f"m/{k}", 0.0) + v * tokens
            with torch.no_grad():
                diff = (logprobs - rollout).abs() * mask
                log_ratio = rollout - logprobs  # k3 estimate of KL(rollout || train)
                sums["k3_sum"] += float(((torch.exp(log_ratio) - 1 - log_ratio) * mask).sum())
                sums["lp_diff_sum"] += float(diff.sum())
                sums["entropy_sum"] += float((entropy * mask).sum())
                lp_diff_max = max(lp_diff_max, float(diff.max()) if diff.numel() else 0.0)
            sums["tokens"] += tokens
        if self.routes is not None:
            sums["route_differ"], sums["route_recorded"] = self.routes.take_mismatch()
        grad_norm, skipped = self.clip_and_step(sums["loss"])
        reduced = torch.tensor([sums[k] for k in sums] + [local_units], dtype=torch.float64)
        dist.all_reduce(reduced, group=self.dp_group)
        r = dict(zip(list(sums) + ["units"], reduced.tolist()))
        max_t = torch.tensor([lp_diff_max], dtype=torch.float64)
        dist.all_reduce(max_t, op=dist.ReduceOp.MAX, group=self.dp_group)
        tokens = max(r["tokens"], 1.0)
        metrics = {k[2:]: v / tokens for k, v in r.items() if k.startswith("m/")}
        return {
            **metrics,
            "loss": r["loss"] / max(r["units"], 1.0),
            "grad_norm": grad_norm,
            "step_skipped": float(skipped),
            "train_rollout_logprob_abs_diff_mean": r["lp_diff_sum"] / tokens,
            "train_rollout_logprob_abs_diff_max": float(max_t),
            "train_rollout_k3_kl": r["k3_sum"] / tokens,
            "entropy": r["entropy_sum"] / tokens,
            "is_weight_clipped_frac": r["clipped_tokens"] / tokens,
            "ref_kl": r["ref_kl_sum"] / tokens,
            "num_tokens": r["tokens"],
            # MoE: share of (token, layer) expert sets the trainer's own routers choose unlike the rollout's
            **({"moe_route_mismatch_frac": r["route_differ"] / max(r["route_recorded"], 1.0)} if self.routes else {}),
        }

    # --- weight sync ----------------------------------------------------------------------------
    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        """What a weight sync sends: every parameter, or only the adapters of a LoRA policy (engine names)."""
        return adapter_tensors(self.hf_model) if self.adapter else list(self.hf_model.named_parameters())

    def sync_plan(self, dtype: torch.dtype, bucket_bytes: int) -> SyncPlan:
        """Bucket plan over the HF-named parameters (tied ones once), cast to ``dtype``; LoRA: the adapters only."""
        specs = [(n, tuple(p.shape), dtype) for n, p in self._named_params()]
        return plan_buckets(specs, bucket_bytes, adapter=self.adapter)

    @torch.no_grad()
    def hf_state(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """Collective: the full weights under HF names on rank 0, LoRA adapters merged in, and the adapters.

        Returns:
            ``(weights, adapters)`` on rank 0 (``adapters`` None without LoRA), ``(None, None)`` elsewhere.

        """

        def full(p: torch.Tensor) -> torch.Tensor:
            return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()  # FSDP2 DTensor: all-gather

        lora = {n: full(p) for n, p in adapter_tensors(self.hf_model)} if self.adapter else {}
        weights = {}
        for name, p in base_tensors(self.hf_model) if self.adapter else self.hf_model.named_parameters():
            t = full(p)
            prefix = name.removesuffix(".weight")
            if f"{prefix}.lora_A.weight" in lora:
                t = merged_weight(t, lora[f"{prefix}.lora_A.weight"], lora[f"{prefix}.lora_B.weight"],
                                  self.adapter.scaling)  # fmt: skip
            if self.rank == 0:
                weights[name] = t.to("cpu", dtype).clone()
        if self.rank != 0:
            return None, None
        return weights, ({n: t.to("cpu", dtype).clone() for n, t in lora.items()} if self.adapter else None)

    @torch.no_grad()
    def gather_bucket(self, bucket: Bucket, dtype: torch.dtype) -> torch.Tensor | None:
        """Collective: gather the bucket's (possibly sharded) parameters; rank 0 returns them packed."""
        params = dict(self._named_params())
        flat = torch.empty(bucket.numel, dtype=dtype) if self.rank == 0 else None
        for m in bucket.tensors:
            p = params[m.name]
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 DTensor: all-gather
            if flat is not None:
                flat[m.offset : m.offset + m.numel].copy_(full.detach().reshape(-1).to("cpu", dtype))
        return flat


__all__ = ["PolicyRank", "TorchBackend", "load_causal_lm", "token_logprobs"]
