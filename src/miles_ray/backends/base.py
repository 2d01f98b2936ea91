"""The ``TrainBackend`` interface a trainer rank drives, and the training config shared by backends."""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from pydantic import Field, model_validator

from miles_ray.backends.lora import LoRAConfig
from miles_ray.config import StrictConfig
from miles_ray.models.quant import WeightFormatConfig
from miles_ray.sync.plan import SyncPlan
from miles_ray.types import RolloutBatch


class OptimizerConfig(StrictConfig):
    """AdamW settings."""

    lr: float = Field(1e-6, gt=0.0, le=1.0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global grad norm; 0 disables clipping.")

    @model_validator(mode="after")
    def _check_betas(self) -> OptimizerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        return self


class TorchBackendConfig(StrictConfig):
    """PyTorch backend: HF ``AutoModelForCausalLM`` wrapped with FSDP2 (``fully_shard``) or DDP."""

    kind: Literal["torch"] = "torch"
    parallel: Literal["fsdp2", "ddp"] = Field("fsdp2", description="Data-parallel wrapping of the model.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the trained model.")
    autocast: Literal["none", "bfloat16", "auto"] = Field(
        "none",
        description="Mixed precision: bfloat16 autocast of forward/backward (fp32 master weights). 'auto': bfloat16 "
        "where the rank's device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), else none "
        "(an AVX2-only CPU emulates bf16 matmuls, ~17x slower than fp32).",
    )
    micro_batch_size: int = Field(8, ge=1, le=4096, description="Samples per forward/backward on one rank.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    num_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per rank.")
    lora: LoRAConfig | None = Field(
        None,
        description="Train LoRA adapters (peft) on frozen base weights; weight sync then sends the adapters only. "
        "Policy only. None trains all weights.",
    )
    weight_format: WeightFormatConfig | None = Field(
        None,
        description="Low-precision recipe (fp8 / int4): the forward goes through the rollout engines' weight format "
        "with a straight-through gradient (QAT); give the engines the same config. Policy only. None: plain weights.",
    )

    routing_replay: bool = Field(
        False,
        description="MoE policies: route each token to the experts the rollout engine chose for it (R3), with the "
        "trainer's own router weights at those experts. Needs samples from embedded engines (they record routes). "
        "Policy only.",
    )

    @model_validator(mode="after")
    def _check_lora_and_format(self) -> TorchBackendConfig:
        if self.lora is not None and self.weight_format is not None:
            raise ValueError("lora and weight_format cannot be combined yet: set one of them")
        return self


def policy_only(backend: TorchBackendConfig, owner: str) -> TorchBackendConfig:
    """Field check for the critic's and the reference's backend: no ``lora``, ``weight_format`` or ``routing_replay``.

    Raises:
        ValueError: naming ``owner`` and the field if either is set.

    """
    if backend.lora is not None:
        raise ValueError(
            f"{owner}.backend.lora must be None: LoRA applies to the policy only (TrainerGroupConfig.backend.lora); "
            "a LoRA policy's KL reference is its base weights with the adapters off, no ReferenceGroup needed"
        )
    if backend.weight_format is not None:
        raise ValueError(
            f"{owner}.backend.weight_format must be None: the low-precision recipe applies to the policy only "
            "(TrainerGroupConfig.backend.weight_format and the engines)"
        )
    if backend.routing_replay:
        raise ValueError(f"{owner}.backend.routing_replay must be False: routing replay applies to the policy only")
    return backend


class TrainBackend(Protocol):
    """What a trainer rank needs from a backend (torch here; Megatron is another implementation)."""

    def compute_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """``[B, T-1]`` next-token logprobs of ``batch.input_ids`` at ``temperature``."""
        ...

    def train_step(self, batch: RolloutBatch, temperature: float) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns metrics averaged over ranks."""
        ...

    def sync_plan(self, dtype: torch.dtype, bucket_bytes: int) -> SyncPlan:
        """Bucket plan of the HF-named parameters cast to ``dtype``."""
        ...

    def gather_bucket(self, bucket, dtype: torch.dtype) -> torch.Tensor | None:
        """Collective over ranks: the bucket packed as one flat tensor on rank 0, None elsewhere."""
        ...

    def save(self, path: str) -> None:
        """Save model and optimizer state (collective)."""
        ...

    def load(self, path: str) -> None:
        """Load model and optimizer state saved by ``save`` (collective)."""
        ...
