"""PyTorch training backend: HF causal LM, FSDP2 or DDP over a gloo (CPU) / NCCL (GPU) group, AdamW.

``TorchBackend`` is one rank of the policy. It implements the ``TrainBackend`` primitives
(``backends.interface``): token logprobs and entropy of a micro-batch, backward, gradient sync, the clipped step,
sums over the data-parallel ranks, weights out for a sync, checkpoints. The RL objective (shaping, advantages,
the loss, the metrics) is ``backends.rl_step.RLStep``, which drives these primitives.

``PolicyModel`` is the same model frozen: the KL reference on a trainer rank or in a ``ReferenceGroup``.

Usage (inside a rank whose ``torch.distributed`` default group is initialised)::

    backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-5), model_path)
    metrics = RLStep(backend, Objective(loss=PPOClipLossConfig())).update(batch.shard(rank, world))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from miles_ray.backends.flat_params import bucket_view
from miles_ray.backends.logprobs import token_logprobs
from miles_ray.backends.lora import adapter_tensors, base_tensors, inject_lora, merged_weight, set_adapters_enabled
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import PackedBatch, pack_rows
from miles_ray.backends.routing import RouteTracker, find_routers, track_routes
from miles_ray.backends.torch_parallel import (
    DataParallelModel,
    TorchBackendConfig,
    forward_backward_in_turn,
    param_dtype,
)
from miles_ray.models.quant import apply_weight_format
from miles_ray.sync.buckets import Bucket, SyncPlan, plan_buckets
from miles_ray.types import RolloutBatch


def load_causal_lm(model_path: str, config: TorchBackendConfig) -> torch.nn.Module:
    """The HF causal LM at ``model_path`` in the config's dtype, without a generation KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=param_dtype(config), attn_implementation="sdpa")
    model.config.use_cache = False
    return model


class PolicyModel(DataParallelModel):
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

    def micro_batch(self, batch: RolloutBatch):
        """Context for a forward (and its backward) over ``batch``: compare / replay its routes (MoE).

        Raises:
            ValueError: with ``routing_replay`` on and a batch that carries no routes.

        """
        packed = None if self.routes is None else self.packed(batch)
        return track_routes(self.routes, batch, packed, self.config.routing_replay)

    def route_counts(self) -> tuple[float, float] | None:
        """MoE: ``(differing, recorded)`` (token, layer) expert sets since the last call, reset; else None."""
        return None if self.routes is None else self.routes.take_mismatch()

    def packed(self, batch: RolloutBatch) -> PackedBatch | None:
        """The batch as packed rows (``config.packing``), or None for the padded layout."""
        p = self.config.packing
        return None if p is None else pack_rows(batch, p.share_prefix, p.max_row_tokens)

    def forward_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T-1]`` next-token logprobs and entropies of the trained tokens (0 elsewhere).

        The LM head and log-softmax over the vocabulary dominate a small model's cost; prompt positions carry no
        loss, so their logits are never formed (``logits_to_keep``). Packed (``config.packing``), a shared prompt is
        forwarded once for every sample that starts with it.
        """
        packed = self.packed(batch)
        if packed is None:
            return self._padded_logprobs(batch, temperature)
        keep = packed.columns().to(self.device)
        with self.forward_context():
            out = self.model(
                input_ids=packed.input_ids.to(self.device),
                position_ids=packed.position_ids.to(self.device),
                attention_mask=packed.attention.to(self.device),
                logits_to_keep=keep,
            )
        targets = batch.input_ids[:, 1:][packed.source >= 0].to(self.device)
        lp, entropy = token_logprobs(packed.needed(out.logits, keep)[None], targets[None], temperature)
        return packed.scatter(lp[0]), packed.scatter(entropy[0])

    def _padded_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs`` on one padded row per sample, logits from the first trained position on."""
        input_ids = batch.input_ids.to(self.device)
        start = batch.first_trained_position()
        keep = torch.arange(start, input_ids.shape[1] - 1, device=self.device)
        with self.forward_context():
            out = self.model(
                input_ids=input_ids, attention_mask=batch.attention_mask.to(self.device), logits_to_keep=keep
            )
        lp, entropy = token_logprobs(out.logits, input_ids[:, start + 1 :], temperature)
        pad = lp.new_zeros(lp.shape[0], start)
        return torch.cat([pad, lp], dim=1), torch.cat([pad, entropy], dim=1)


class AdaptersOffReference:
    """A LoRA policy's frozen reference: the same model with its adapters off (the base weights, no second copy)."""

    def __init__(self, policy: PolicyModel):
        self.policy = policy

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The policy's."""
        return self.policy.micro_batches(batch)

    def train(self, mode: bool = True) -> None:
        """The policy's mode."""
        self.policy.train(mode)

    def micro_batch(self, batch: RolloutBatch):
        """No route tracking: the reference's routes are not the policy's to compare."""
        return contextlib.nullcontext()

    def forward_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``PolicyModel.forward_logprobs``, on the base weights."""
        set_adapters_enabled(self.policy.hf_model, False)
        try:
            return self.policy.forward_logprobs(batch, temperature)
        finally:
            set_adapters_enabled(self.policy.hf_model, True)


class TorchBackend(PolicyModel):
    """One data-parallel rank of the policy trained with FSDP2 or DDP.

    With ``reference``, the frozen KL reference (the initial weights) is loaded on this rank, placed and sharded
    like the policy (a LoRA policy uses its own base weights, adapters off); otherwise reference logprobs come in
    with each step (from a ``ReferenceGroup`` actor).
    """

    def __init__(self, config: TorchBackendConfig, optim: OptimizerConfig, model_path: str, reference: bool = False):
        super().__init__(config, optim, model_path)
        self.reference = None
        if reference:
            self.reference = AdaptersOffReference(self) if self.adapter else PolicyModel(config, None, model_path)

    def forward_backward(self, batches, temperature: float, loss_of, total_units: float) -> list[dict[str, float]]:
        """The micro-batches in turn (``torch_parallel.forward_backward_in_turn``)."""
        return forward_backward_in_turn(self, batches, temperature, loss_of, total_units)

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
        lora = {n: _full(p) for n, p in adapter_tensors(self.hf_model)} if self.adapter else {}
        weights = {}
        for name, p in base_tensors(self.hf_model) if self.adapter else self.hf_model.named_parameters():
            t = _full(p)
            prefix = name.removesuffix(".weight")
            if f"{prefix}.lora_A.weight" in lora:
                a, b = lora[f"{prefix}.lora_A.weight"], lora[f"{prefix}.lora_B.weight"]
                t = merged_weight(t, a, b, self.adapter.scaling)
            if self.rank == 0:
                weights[name] = t.to("cpu", dtype).clone()
        if self.rank != 0:
            return None, None
        return weights, ({n: t.to("cpu", dtype).clone() for n, t in lora.items()} if self.adapter else None)

    @torch.no_grad()
    def gather_bucket(self, bucket: Bucket, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Collective: gather the bucket's (possibly sharded) parameters; rank 0 returns them packed (into ``out``)."""
        params = self._sync_sources(dtype)
        flat = None
        if self.rank == 0:
            flat = torch.empty(bucket.numel, dtype=dtype) if out is None else out
        for m in bucket.tensors:
            full = _full(params[m.name])
            if flat is not None:
                flat[m.offset : m.offset + m.numel].copy_(full.reshape(-1))  # cast and move in one pass
        return flat

    def bucket_in_place(self, bucket: Bucket) -> torch.Tensor | None:
        """The bucket as a view of the parameters' memory (``flat_params``) or of their ``weight_copy``, or None."""
        return bucket_view(bucket, self._sync_sources(bucket.dtype)) if self.rank == 0 else None

    def publish_in_place(self, dtype: torch.dtype, make_buffer: Callable[[int], torch.Tensor]) -> bool:
        """Rank 0 with a ``weight_copy`` in ``dtype``: publish it (``WeightCopy.publish``)."""
        if self.rank != 0 or self.weight_copy is None or self.weight_copy.dtype != dtype:
            return False
        return self.weight_copy.publish(make_buffer)

    def _sync_sources(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """What a sync in ``dtype`` reads: the weight copy when it is in that dtype (no cast), else the weights."""
        if self.weight_copy is not None and self.weight_copy.dtype == dtype:
            return self.weight_copy.tensors()
        return dict(self._named_params())


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (an FSDP2 ``DTensor`` is all-gathered, unless one rank holds it all)."""
    if hasattr(p, "full_tensor"):
        p = p.to_local() if p.device_mesh.size() == 1 else p.full_tensor()
    return p.detach()


__all__ = ["AdaptersOffReference", "PolicyModel", "TorchBackend", "load_causal_lm"]
