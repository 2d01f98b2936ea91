"""LoRA adapters in the embedded engine's model: unmerged, so weight sync sends only the adapter tensors.

``add_lora(model, spec)`` turns every ``nn.Linear`` whose own name is in ``spec.target_modules`` into a
``LoRALinear``: the base weight keeps its HF name (``...q_proj.weight``) and the adapter adds
``...q_proj.lora_A.weight`` ``[rank, in]`` and ``...q_proj.lora_B.weight`` ``[out, rank]``, zero-initialised
``B`` (the model is unchanged until the first sync). The forward is peft's, term for term
(``base(x) + B(A(x)) * scaling``), so the engine's logprobs equal a peft-trained policy's in fp32.

Keeping the adapter unmerged costs two skinny matmuls per layer but keeps the base weights bit-exact across
any number of syncs (merging into bf16 weights and un-merging drifts) and is what SGLang and vLLM do.

Usage::

    names = add_lora(model, AdapterSpec(rank=16, scaling=2.0, target_modules=("q_proj", "v_proj")))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles_ray.sync.buckets import AdapterSpec


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus an unmerged low-rank update; shares the base layer's weight and bias tensors."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float):
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight, self.bias = base.weight, base.bias
        kw = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.zeros_(self.lora_A.weight)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_A.requires_grad_(base.weight.requires_grad)
        self.lora_B.requires_grad_(base.weight.requires_grad)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``base(x) + lora_B(lora_A(x)) * scaling`` (peft's order of operations)."""
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, spec: AdapterSpec) -> list[str]:
    """Wrap the target linear layers of ``model`` in place.

    Returns:
        The names of the new adapter parameters.

    Raises:
        ValueError: if no ``nn.Linear`` is named like a target module, or the model already has adapters.

    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("add_lora: the model already has LoRA adapters")
    targets = set(spec.target_modules)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise ValueError(f"add_lora: no linear layer is named one of {sorted(targets)}")
    names = []
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, spec.rank, spec.scaling))
        names += [f"{name}.lora_A.weight", f"{name}.lora_B.weight"]
    return names


__all__ = ["LoRALinear", "add_lora"]
