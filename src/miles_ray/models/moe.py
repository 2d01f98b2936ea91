"""Sparse mixture-of-experts feed-forward for the embedded engine (Mixtral / Qwen3-MoE-style top-k routing).

Parameter names and layouts equal transformers' in-memory ones (``mlp.gate.weight`` ``[E, H]``,
``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``), so a weight sync
from an HF trainer loads as is; ``fuse_checkpoint_experts`` maps the per-expert checkpoint layout
(``block_sparse_moe.experts.N.w1/w2/w3``) onto them when a model directory is loaded.

Routing follows HF: softmax over the router logits in fp32, top-k, the k weights renormalised to sum to
1 (``norm_topk_prob``). Every forward records the experts it picked (``last_routes``, ``[N, k]``), which
the engine hands back per token so the trainer can replay them (``miles_ray.backends.routing``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Linear router ``[E, H]`` choosing ``top_k`` experts per token."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[N, H]`` -> ``(weights [N, k] fp32, experts [N, k] long)``."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class Experts(nn.Module):
    """``E`` SwiGLU experts stored as 3-D tensors (HF's fused layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum of each token's chosen experts, weighted: ``x`` ``[N, H]``, ``experts``/``weights`` ``[N, k]``."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # only the experts some token chose
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Router + experts; ``last_routes`` holds the experts chosen in the latest forward (``[N, k]`` long)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.last_routes: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, S, H]`` -> ``[B, S, H]``."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        self.last_routes = experts
        return self.experts(flat, experts, weights).view_as(x)


_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def fuse_checkpoint_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Map a checkpoint's per-expert tensors onto the fused in-memory names (other names pass through).

    Mixtral checkpoints hold ``block_sparse_moe.experts.N.w1/w3/w2`` (gate/up/down) and
    ``block_sparse_moe.gate``; Qwen-MoE ones ``mlp.experts.N.gate_proj/up_proj/down_proj``.

    Raises:
        ValueError: if a layer's experts are incomplete.

    """
    out, parts = {}, {}
    for name, t in state.items():
        if m := _PER_EXPERT.match(name):
            parts.setdefault(m[1], {}).setdefault(_ROLE[m[4]], {})[int(m[3])] = t
        elif m := _ROUTER.match(name):
            out[f"{m[1]}.mlp.gate.weight"] = t
        else:
            out[name] = t
    for layer, roles in parts.items():
        for role in ("gate", "up", "down"):
            if sorted(roles.get(role, {})) != list(range(num_experts)):
                raise ValueError(
                    f"{layer}: checkpoint holds experts {sorted(roles.get(role, {}))} of {role}, "
                    f"expected 0..{num_experts - 1}"
                )
        gate_up = [torch.cat([roles["gate"][e], roles["up"][e]]) for e in range(num_experts)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([roles["down"][e] for e in range(num_experts)])
    return out
