"""What every torch-trained model rank shares: device, FSDP2/DDP wrapping, AdamW, global sums, DCP checkpoints.

``TorchRank`` holds one data-parallel rank of a module: the policy (``TorchBackend``) and the critic
(``TorchCriticBackend``) build their module and hand it here; a frozen module (the reference policy) gets
no optimizer. The module must expose its decoder layers as ``module.model.layers`` (HF causal LMs and
``ValueModel`` do): FSDP2 shards each layer, then the whole module.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig


def rank_device() -> torch.device:
    """The device of the calling rank: the CUDA device Ray gave the actor, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def param_dtype(config: TorchBackendConfig) -> torch.dtype:
    """The parameter dtype a backend config asks for."""
    return torch.float32 if config.dtype == "float32" else torch.bfloat16


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 matmuls natively (emulated bf16 on a CPU is many times slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def autocast_enabled(config: TorchBackendConfig, device: torch.device) -> bool:
    """Whether a rank on ``device`` runs its forward/backward under bfloat16 autocast (``config.autocast``)."""
    return config.autocast == "bfloat16" or (config.autocast == "auto" and native_bf16(device))


class TorchRank:
    """One data-parallel rank of ``module``, trained with AdamW (or frozen when ``optim`` is None).

    AdamW gets the parameters that require grad (all, or only the LoRA adapters of a frozen base).
    """

    def __init__(self, config: TorchBackendConfig, optim: OptimizerConfig | None, module: torch.nn.Module):
        self.config, self.optim_config = config, optim
        torch.set_num_threads(config.num_threads)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # every rank is a data-parallel rank here (a model-parallel backend narrows these to its DP group)
        self.dp_group, self.dp_rank, self.dp_size = None, self.rank, self.world_size
        self.device = rank_device()
        self.autocast = autocast_enabled(config, self.device)  # bf16 autocast of every forward/backward
        if config.gradient_checkpointing and optim is not None:
            module.gradient_checkpointing_enable()
            if not all(p.requires_grad for p in module.parameters()):  # frozen embeddings (LoRA): keep grads flowing
                module.enable_input_require_grads()
        self.hf_model = module.to(self.device)
        self.optimizer = None
        if optim is None:  # frozen: no gradients; DDP refuses a module without trainable parameters
            self.hf_model.requires_grad_(False).eval()
            self.model = self.hf_model if config.parallel == "ddp" else self.wrap(self.hf_model)
            return
        self.model = self.wrap(self.hf_model)
        self.optimizer = torch.optim.AdamW(
            self.param_groups(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
        )

    def param_groups(self) -> list[dict]:
        """AdamW parameter groups (one, at the config's lr; subclasses may give some parameters their own lr)."""
        return [{"params": [p for p in self.model.parameters() if p.requires_grad]}]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` for data parallelism as the config says (FSDP2 shards it over the ranks)."""
        if self.config.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model) if self.world_size > 1 else model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def global_sum(self, value: float) -> float:
        """``value`` summed over the data-parallel ranks."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, group=self.dp_group)
        return float(t)

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
        skipped = self.global_sum(bad) > 0  # every rank takes the same decision
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def backward_share(self, loss: torch.Tensor, units: float, global_units: float) -> None:
        """Backward ``loss`` weighted by this micro-batch's share of the global batch.

        FSDP2/DDP (and Megatron's DDP) average gradients over the data-parallel ranks; multiplying by their
        count turns that into a sum.
        """
        (loss * units / global_units * self.dp_size).backward()

    # --- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Save model + optimizer with torch distributed checkpoint (sharded, reshardable), and this rank's RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        self.save_rng(path)

    def save_rng(self, path: str) -> None:
        """Write this rank's RNG states into checkpoint directory ``path``."""
        torch.save(self.rng_state(), os.path.join(path, f"rng_rank{self.rank}.pt"))

    def rng_state(self) -> dict:
        """The rank's torch RNG states (CPU, and CUDA when present)."""
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any rank count)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.load_rng(path)

    def load_rng(self, path: str) -> None:
        """Restore this rank's RNG states from checkpoint directory ``path``, if it holds them."""
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng):  # absent when loading at a larger rank count than saved, or an older checkpoint
            saved = torch.load(rng)
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved["cuda"])
