"""One data-parallel rank of a torch model (FSDP2 or DDP, AdamW, DCP checkpoints), and what every trained rank shares.

``DataParallelModel`` holds one rank of a module: the policy (``TorchBackend``) and the critic
(``TorchCriticBackend``) build their module and hand it here; a frozen module (the reference policy) gets no
optimizer. The module must expose its decoder layers as ``module.model.layers`` (HF causal LMs and
``ValueModel`` do): FSDP2 shards each layer, then the whole module.

``DataParallelOps`` (sums, maxima and gathers over a data-parallel group, the backward's share of the global
batch) and the RNG checkpoint helpers serve the Megatron backend too, whose data-parallel group is Megatron's:
backends share these pieces, they do not inherit each other.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator

from miles_ray.backends.flat_params import flatten_parameters
from miles_ray.backends.lora import LoRAConfig
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.packing import MicroBatchConfig, micro_batches_of
from miles_ray.backends.weight_copy import WeightCopy
from miles_ray.devices import configure_host, native_bf16, rank_device, reserve_heap
from miles_ray.models.quant import WeightFormatConfig
from miles_ray.state_codec import load_state, save_state
from miles_ray.types import RolloutBatch


class TorchBackendConfig(MicroBatchConfig):
    """PyTorch backend: HF ``AutoModelForCausalLM`` wrapped with FSDP2 (``fully_shard``) or DDP."""

    kind: Literal["torch"] = "torch"
    parallel: Literal["fsdp2", "ddp"] = Field("fsdp2", description="Data-parallel wrapping of the model.")
    reshard_after_forward: bool = Field(
        True,
        description="FSDP2: free each layer's gathered parameters after its forward and gather them again for the "
        "backward (ZeRO-3, least memory); False keeps them until the backward (ZeRO-2: one all-gather less per step).",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype of the trained model.")
    autocast: Literal["none", "bfloat16", "auto"] = Field(
        "none",
        description="Mixed precision: bfloat16 autocast of forward/backward (fp32 master weights). 'auto': bfloat16 "
        "where the rank's device computes it natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), else none "
        "(an AVX2-only CPU emulates bf16 matmuls, ~17x slower than fp32).",
    )
    weight_copy: bool = Field(
        True,
        description="With bfloat16 autocast on a DDP rank: keep a bf16 copy of the weights, written after "
        "each optimizer step, that the linear layers compute with and a bf16 weight sync sends, instead of autocast "
        "casting every weight in every forward and the sync casting them again (backends.weight_copy; same losses "
        "and gradients exactly). 2 bytes per weight. Not applied with FSDP2, LoRA, weight_format or compile.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    compile: bool = Field(
        False,
        description="torch.compile every decoder layer (dynamic shapes, inductor); the first steps pay the "
        "compilation. Same losses as eager (tested); whether it is faster depends on the device.",
    )
    num_threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per rank.")
    tune_malloc: bool = Field(
        True,
        description="glibc only: keep freed host memory in the rank's heap (mallopt) so each step's large temporaries "
        "do not page-fault afresh; the resident size stays at the step's peak (devices.configure_host). Process-wide.",
    )
    reserve_memory_gb: float = Field(
        0.0,
        ge=0,
        le=4096,
        description="CPU, with tune_malloc: GiB of heap a trained rank touches once when it starts, so the first "
        "steps' activations and optimizer state reuse it instead of page-faulting fresh memory, which on a VM costs "
        "~20x reused memory (devices.reserve_heap). Size it near a step's resident peak. 0: none.",
    )
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
        if self.reserve_memory_gb and not self.tune_malloc:
            raise ValueError("reserve_memory_gb needs tune_malloc=True: an untuned heap gives the memory back on free")
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


def param_dtype(config: TorchBackendConfig) -> torch.dtype:
    """The parameter dtype a backend config asks for."""
    return torch.float32 if config.dtype == "float32" else torch.bfloat16


def autocast_enabled(config: TorchBackendConfig, device: torch.device) -> bool:
    """Whether a rank on ``device`` runs its forward/backward under bfloat16 autocast (``config.autocast``)."""
    return config.autocast == "bfloat16" or (config.autocast == "auto" and native_bf16(device))


class DataParallelOps:
    """What every trained rank does over its data-parallel group: sums, maxima, gathers, the backward's share.

    A backend sets ``dp_group`` (None: the default group), ``dp_size`` and ``device``; these are its
    ``StepPrimitives`` of the same names (``backends.interface``).
    """

    dp_group = None
    dp_size: int
    device: torch.device

    def _on(self) -> str | torch.device:
        return self.device if self.device.type == "cuda" else "cpu"  # NCCL reduces CUDA tensors only

    def global_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over the data-parallel ranks, in float64 (one all-reduce)."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self._on())
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def global_max(self, value: float) -> float:
        """The largest ``value`` over the data-parallel ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=self._on())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return float(t)

    def gather_shards(self, local: torch.Tensor) -> torch.Tensor:
        """Every data shard's ``local`` rows concatenated in shard (group-rank) order, on every rank."""
        parts = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(parts, local.cpu(), group=self.dp_group)
        return torch.cat(parts)

    def backward(self, loss: torch.Tensor, units: float, total_units: float) -> None:
        """Backward ``loss`` weighted by this micro-batch's share (``units / total_units``) of the global batch.

        FSDP2/DDP (and Megatron's DDP) average gradients over the data-parallel ranks; multiplying by their count
        turns that into a sum.
        """
        (loss * units / total_units * self.dp_size).backward()


def forward_backward_in_turn(backend, batches, temperature: float, loss_of, total_units: float) -> list[dict]:
    """``TrainBackend.forward_backward`` without a pipeline: each micro-batch's forward, loss and backward in turn.

    Gradients are reduced once, in the last backward. The backward stays inside the micro-batch's context:
    activation checkpointing re-runs the routers there.
    """
    stats = []
    for i, mb in enumerate(batches):
        backend.grad_sync(i == len(batches) - 1)
        with backend.micro_batch(mb):
            lp, entropy = backend.forward_logprobs(mb, temperature)
            loss, units, s = loss_of(i, mb, lp, entropy)
            backend.backward(loss, units, total_units)
        stats.append(s)
    return stats


FRESH_OPTIMIZER = "optimizer_fresh"  # the file that marks a checkpoint saved before the first optimizer step


def mark_fresh_optimizer(path: str, fresh: bool) -> None:
    """Mark checkpoint directory ``path`` as saved before the first optimizer step, or unmark a re-save after one.

    Every rank marks: nodes need not share the directory. What a fresh optimizer leaves on file is only a placeholder
    (torch's ``get_state_dict`` makes state by a zero step; Megatron saves none), which ``load`` must not restore.
    """
    marker = os.path.join(path, FRESH_OPTIMIZER)
    if fresh:
        open(marker, "w").close()
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)


def saved_fresh(path: str) -> bool:
    """Whether checkpoint directory ``path`` was saved before the first optimizer step (``mark_fresh_optimizer``)."""
    return os.path.exists(os.path.join(path, FRESH_OPTIMIZER))


def save_rng(path: str, rank: int) -> None:
    """Write this rank's RNG states (CPU, and CUDA when present) into checkpoint directory ``path``."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    save_state(os.path.join(path, f"rng_rank{rank}"), state)  # JSON + safetensors: no pickle


def load_rng(path: str, rank: int) -> None:
    """Restore this rank's RNG states from checkpoint directory ``path``, if it holds them."""
    stem = os.path.join(path, f"rng_rank{rank}")
    if os.path.exists(f"{stem}.json"):
        saved = load_state(stem)
    elif os.path.exists(f"{stem}.pt"):  # saved before 2026-12-05; weights_only: tensors and dicts, no code
        saved = torch.load(f"{stem}.pt", weights_only=True)
    else:  # loading at a larger rank count than saved
        return
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


class DataParallelModel(DataParallelOps):
    """One data-parallel rank of ``module``, trained with AdamW (or frozen when ``optim`` is None).

    AdamW gets the parameters that require grad (all, or only the LoRA adapters of a frozen base). Every rank is a
    data-parallel rank here: the group is the default one.
    """

    def __init__(self, config: TorchBackendConfig, optim: OptimizerConfig | None, module: torch.nn.Module):
        self.config = config
        self.optim_config = optim
        configure_host(config.num_threads, config.tune_malloc)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_group = None
        self.dp_rank = self.rank
        self.dp_size = self.world_size
        self.device = rank_device()
        self.autocast = autocast_enabled(config, self.device)  # bf16 autocast of every forward/backward
        if config.gradient_checkpointing and optim is not None:
            module.gradient_checkpointing_enable()
            if not all(p.requires_grad for p in module.parameters()):  # frozen embeddings (LoRA): keep grads flowing
                module.enable_input_require_grads()
        self.hf_model = module.to(self.device)
        if optim is not None and config.parallel == "ddp" and self.device.type == "cpu":
            # trained parameters in one buffer, in sync order: a sync in their dtype sends them without packing
            flatten_parameters([p for p in module.parameters() if p.requires_grad])
        if config.compile:  # in place, before wrapping: parameter names and FSDP2's per-layer units stay as they are
            for layer in self.hf_model.model.layers:
                layer.compile(dynamic=True)
        self.weight_copy = WeightCopy(self.hf_model) if self._keeps_weight_copy() else None
        self.optimizer = None
        if optim is None:  # frozen: no gradients; DDP refuses a module without trainable parameters
            self.hf_model.requires_grad_(False).eval()
            self.model = self.hf_model if config.parallel == "ddp" else self.wrap(self.hf_model)
            return
        self.model = self.wrap(self.hf_model)
        # fused: one kernel over all parameters; on a CPU ~3x faster than the per-parameter loop torch defaults to
        self.optimizer = torch.optim.AdamW(
            self.param_groups(),
            lr=optim.lr,
            betas=optim.betas,
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,
        )
        if self.weight_copy is not None:  # written once per step, as Megatron writes its bf16 model weights
            self.optimizer.register_step_post_hook(lambda *_: self.weight_copy.refresh(force=True))
        if config.reserve_memory_gb and self.device.type == "cpu":
            reserve_heap(config.reserve_memory_gb)

    def _keeps_weight_copy(self) -> bool:
        """``config.weight_copy`` where it applies: bf16 autocast of fp32 plain weights, each rank holding them all."""
        c = self.config
        # LoRA and fake-quant layers compute otherwise; compiled layers would recompile for every new tensor; FSDP2
        # holds a shard of each weight, gathered per layer (a bf16 MixedPrecisionPolicy would be its equivalent)
        plain = c.lora is None and c.weight_format is None and not c.compile and param_dtype(c) == torch.float32
        return c.weight_copy and self.autocast and plain and c.parallel == "ddp"

    def forward_context(self) -> contextlib.AbstractContextManager:
        """A forward's precision: bf16 autocast when on, the linear layers reading the weight copy when kept."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast))
        if self.weight_copy is not None:
            stack.enter_context(self.weight_copy.linear_weights())
        return stack

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The batch's rows cut into micro-batches of whole shared-prefix segments (``backends.packing``)."""
        return micro_batches_of(batch, self.config)

    def param_groups(self) -> list[dict]:
        """AdamW parameter groups (one, at the config's lr; subclasses may give some parameters their own lr)."""
        return [{"params": [p for p in self.model.parameters() if p.requires_grad]}]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` for data parallelism as the config says (FSDP2 shards it over the ranks)."""
        if self.config.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # gradients as views of the reduction buckets: no copy into the buckets and back each step
            return DistributedDataParallel(model, gradient_as_bucket_view=True) if self.world_size > 1 else model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        reshard = self.config.reshard_after_forward
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model

    def train(self, mode: bool = True) -> None:
        """Training mode (gradient checkpointing active) or evaluation mode."""
        self.model.train(mode)

    # --- the primitives an RL step drives (backends.interface.StepPrimitives) --------------------------------------
    def grad_sync(self, enabled: bool) -> None:
        """Turn gradient reduction on (last micro-batch) or off (the ones before it)."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(enabled)
        elif hasattr(self.model, "require_backward_grad_sync"):  # DDP
            self.model.require_backward_grad_sync = enabled

    def clip_and_step(self, loss_sum: float = 0.0) -> tuple[float, bool]:
        """Clip the global grad norm and step, unless the step is not finite on some rank.

        A non-finite gradient norm (global already) or a non-finite ``loss_sum`` on any rank skips the
        optimizer step on every rank: weights and optimizer state stay as they were, the gradients are dropped.

        Returns:
            ``(grad norm, skipped)``.

        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.optim_config.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        bad = 0.0 if math.isfinite(norm) and math.isfinite(loss_sum) else 1.0
        skipped = self.global_sum([bad])[0] > 0  # every rank takes the same decision
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    # --- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Save model + optimizer with torch distributed checkpoint (sharded, reshardable), and this rank's RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        fresh = not self.optimizer.state  # no step taken yet
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        if fresh:  # get_state_dict made the state by a zero-gradient step, which AdamW would count: undo it
            self.optimizer.state.clear()
        mark_fresh_optimizer(path, fresh)
        save_rng(path, self.rank)

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any rank count)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if saved_fresh(path):  # the state on file is only that zero step
            self.optimizer.state.clear()
        if self.weight_copy is not None:
            self.weight_copy.invalidate()
        load_rng(path, self.rank)
