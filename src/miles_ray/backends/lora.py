"""LoRA training with peft: adapters injected into the HF model in place, base weights frozen.

``inject_lora`` adds peft LoRA layers to an HF causal LM without wrapping it in a ``PeftModel``, so the module
tree (``model.model.layers``, which FSDP2 shards layer by layer) stays as it was. What leaves a trainer is
named as the engines and HF name it:

- weight sync sends the adapter only (``adapter_tensors``): ``...q_proj.lora_A.weight`` ``[r, in]`` and
  ``...q_proj.lora_B.weight`` ``[out, r]`` with an ``AdapterSpec`` the engines apply unmerged;
- HF export merges (``merged_weight``: ``W + scaling * B @ A``) under the base names (``...q_proj.weight``),
  and ``write_peft_adapter`` writes the adapter in peft's own format next to it.

Usage::

    spec = inject_lora(hf_model, LoRAConfig(rank=16, alpha=32))
    names = [n for n, _ in adapter_tensors(hf_model)]
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field, field_validator

from miles_ray.config import StrictConfig
from miles_ray.sync.buckets import AdapterSpec

_ADAPTER = "default"  # peft's adapter name; one adapter per model here


class LoRAConfig(StrictConfig):
    """Low-rank adapters trained instead of the full weights (peft LoRA)."""

    rank: int = Field(16, ge=1, le=1024, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0.0, le=1e4, description="Scaling numerator: updates scale by alpha / r.")
    target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Names of the linear layers that get adapters (e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj).",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input while training.")
    use_rslora: bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r.")

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in value if not t.isidentifier()]
        if bad:
            raise ValueError(f"target_modules must be module names like 'q_proj' (no dots or patterns), got {bad}")
        return value


def _peft_config(config: LoRAConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        use_rslora=config.use_rslora,
        bias="none",
    )


def inject_lora(model: torch.nn.Module, config: LoRAConfig) -> AdapterSpec:
    """Add LoRA layers to ``model`` in place and freeze everything else.

    Returns:
        The adapter's spec for the engines.

    Raises:
        ValueError: if a target module name matches no linear layer of the model.

    """
    from peft import inject_adapter_in_model

    linear_names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(set(config.target_modules) - linear_names)
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} name no linear layer of the model; "
            f"its linear layers: {sorted(linear_names)}"
        )
    inject_adapter_in_model(_peft_config(config), model)
    # peft (with transformers 5) maps gate_proj/up_proj/down_proj of an MoE model onto its fused 3-D expert tensors
    # (and so off the dense layers' MLPs); the engines take adapters on linear layers only
    off_linear = [
        n for n, m in model.named_modules() if _is_lora(m) and not isinstance(m.get_base_layer(), torch.nn.Linear)
    ]
    if off_linear:
        raise ValueError(
            f"lora.target_modules {list(config.target_modules)} put adapters on {off_linear[0]}, which is no linear "
            "layer (peft maps gate_proj/up_proj/down_proj of an MoE model onto its fused expert tensors); engines "
            "take adapters on linear layers only: on MoE models target the attention projections "
            "(q_proj, k_proj, v_proj, o_proj)"
        )
    scalings = {m.scaling[_ADAPTER] for m in _lora_layers(model)}
    assert len(scalings) == 1, scalings
    return AdapterSpec(rank=config.rank, scaling=float(scalings.pop()), target_modules=tuple(config.target_modules))


def _is_lora(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _lora_layers(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if _is_lora(m)]


def set_adapters_enabled(model: torch.nn.Module, enabled: bool) -> None:
    """Turn the adapters on or off (off: the model is the frozen base, e.g. the KL reference)."""
    for layer in _lora_layers(model):
        layer.enable_adapters(enabled)


def hf_name(peft_name: str) -> str:
    """The engine/HF name of a parameter of an injected model.

    ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``; ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``; other names are unchanged.
    """
    return peft_name.replace(".base_layer.", ".").replace(f".{_ADAPTER}.", ".")


def adapter_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter parameters (``lora_A``/``lora_B``) under their engine names, in module order."""
    return [(hf_name(n), p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def base_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base (non-adapter) parameters under their HF names, tied ones once."""
    return [(hf_name(n), p) for n, p in model.named_parameters() if ".lora_A." not in n and ".lora_B." not in n]


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * B @ A`` computed in fp32 (full tensors: ``base [out, in]``, ``A [r, in]``, ``B [out, r]``)."""
    return (base.float() + scaling * (lora_b.float() @ lora_a.float())).to(base.dtype)


def write_peft_adapter(
    out: str | Path, config: LoRAConfig, base_model_path: str, tensors: dict[str, torch.Tensor]
) -> Path:
    """Write ``tensors`` (engine names, from ``adapter_tensors``) as a peft adapter directory.

    ``peft.PeftModel.from_pretrained(base, out)`` loads it (keys ``base_model.model.<name>``).
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=False)
    peft_cfg = _peft_config(config)
    peft_cfg.base_model_name_or_path = base_model_path
    peft_cfg.save_pretrained(str(out))  # adapter_config.json, as peft writes it
    state = {f"base_model.model.{n}": t.contiguous() for n, t in tensors.items()}
    save_file(state, str(out / "adapter_model.safetensors"), {"format": "pt"})
    return out


__all__ = [
    "LoRAConfig",
    "adapter_tensors",
    "base_tensors",
    "hf_name",
    "inject_lora",
    "merged_weight",
    "set_adapters_enabled",
    "write_peft_adapter",
]
