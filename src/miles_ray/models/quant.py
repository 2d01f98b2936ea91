"""Low-precision weight formats as numerics: blockwise-scaled FP8 (e4m3) and group-wise symmetric INT4.

These are the quantisers a low-precision recipe uses on both sides of RL: the rollout engine holds weights in the
format, and the trainer computes its logprobs through the same quantise-dequantise (its *view* of the rollout
weights) so the two agree; for INT4 QAT the trainer trains through it with a straight-through estimator. On CPU
the matmul is emulated (dequantise, then a bf16/fp32 matmul); the rounding is the real format's.

- FP8: DeepSeek-V3 style ``weight`` ``float8_e4m3fn`` ``[out, in]`` and ``weight_scale_inv`` fp32
  ``[ceil(out/b), ceil(in/b)]``, one scale per ``b x b`` block (``w ~= q * scale_inv``).
- INT4: codes in ``[-8, 7]`` (int8 storage here) and one fp32 scale per ``g`` consecutive inputs of a row
  (``w ~= code * scale``, ``scale = amax / 7``).

Usage::

    q, scale_inv = fp8_blockwise(w)               # w: [out, in]
    w_hat = fp8_dequantize(q, scale_inv, 128)      # [out, in]
    w_qat = fake_quant(w, "int4")                  # forward int4 values, gradient passes straight through

As a recipe: one ``WeightFormatConfig`` given to the engines (``EmbeddedEngineConfig.weight_format``) and the
trainer (``TorchBackendConfig.weight_format``); ``apply_weight_format`` swaps the linear layers on each side.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from miles_ray.config import StrictConfig

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_MIN, INT4_MAX = -8, 7
Format = Literal["fp8", "int4"]


def _pad_to(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[out, in]`` to e4m3 with one scale per ``block x block`` tile.

    Returns:
        ``(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out/block), ceil(in/block)])``.

    """
    out, inp = w.shape
    nr, nc = -(-out // block), -(-inp // block)
    tiles = _pad_to(w.float(), nr * block, nc * block).view(nr, block, nc, block)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = FP8_MAX / amax
    q = (tiles * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(nr * block, nc * block)[:out, :inp].contiguous()
    return q, (1.0 / scale).view(nr, nc)


def fp8_dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q * scale_inv`` tile by tile (``block`` as given to ``fp8_blockwise``)."""
    out, inp = q.shape
    full = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]
    return (q.float() * full).to(dtype)


def int4_groupwise(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[out, in]`` to symmetric int4 codes with one scale per ``group`` inputs of a row.

    Returns:
        ``(codes int8 in [-8, 7] [out, in], scales float32 [out, ceil(in/group)])``.

    """
    out, inp = w.shape
    ng = -(-inp // group)
    groups = _pad_to(w.float(), out, ng * group).view(out, ng, group)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / INT4_MAX).clamp(min=1e-12)
    codes = torch.round(groups / scale).clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return codes.view(out, ng * group)[:, :inp].contiguous(), scale.view(out, ng)


def int4_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * scale`` group by group (``group`` as given to ``int4_groupwise``)."""
    inp = codes.shape[1]
    return (codes.float() * scales.repeat_interleave(group, 1)[:, :inp]).to(dtype)


def quant_dequant(w: torch.Tensor, fmt: Format, block: int = 128) -> torch.Tensor:
    """``w`` rounded through ``fmt`` and back, in ``w``'s dtype (what an engine holding ``fmt`` computes with)."""
    if fmt == "fp8":
        return fp8_dequantize(*fp8_blockwise(w, block), block, dtype=w.dtype)
    if fmt == "int4":
        return int4_dequantize(*int4_groupwise(w, block), block, dtype=w.dtype)
    raise ValueError(f"format must be 'fp8' or 'int4', got {fmt!r}")


def fake_quant(w: torch.Tensor, fmt: Format, block: int = 128) -> torch.Tensor:
    """Forward: ``quant_dequant(w)``; backward: identity (straight-through estimator), for QAT and trainer views."""
    return w + (quant_dequant(w.detach(), fmt, block) - w).detach()


class WeightFormatConfig(StrictConfig):
    """A low-precision rollout recipe: the format engines hold linear weights in, and the trainer's view of it.

    Pass the same object to ``EmbeddedEngineConfig.weight_format`` (engines compute with the rounded weights) and
    ``TorchBackendConfig.weight_format`` (the trainer's forward, logprobs and training alike, goes through the
    same rounding with a straight-through gradient to its full-precision weights: QAT). Pair it with
    ``TrainerGroupConfig.mismatch_correction={"kind": "tis"}`` for what rounding differences remain.
    """

    format: Format = Field(..., description="fp8 (e4m3, one scale per block x block tile) or int4 (symmetric).")
    block: int = Field(128, ge=8, le=4096, description="FP8 tile side / INT4 group size (inputs per scale).")


def _targets(model: torch.nn.Module, skip: tuple[str, ...]) -> list[tuple[str, torch.nn.Linear]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in skip
    ]


class FakeQuantLinear(torch.nn.Linear):
    """Trainer side: ``F.linear(x, fake_quant(weight))``; under FSDP2 ``weight`` is the gathered full weight here."""

    weight_format: WeightFormatConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Linear layer on the rounded weight; the gradient reaches the full-precision weight unchanged (STE)."""
        fmt = self.weight_format
        return F.linear(x, fake_quant(self.weight, fmt.format, fmt.block), self.bias)


class RoundedLinear(torch.nn.Linear):
    """Engine side: computes with ``rounded`` (the weight through the format), refreshed after each weight load.

    ``weight`` keeps the bytes the trainer sent (so sync checksums still compare what was sent), ``rounded`` is a
    non-persistent buffer: emulation holds both (no FP8/INT4 matmul kernels on CPU).
    """

    weight_format: WeightFormatConfig

    def refresh(self) -> None:
        """Round the current weight through the format into ``rounded``."""
        fmt = self.weight_format
        self.register_buffer("rounded", quant_dequant(self.weight.detach(), fmt.format, fmt.block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Linear layer on the rounded weight."""
        return F.linear(x, self.rounded, self.bias)


def apply_weight_format(
    model: torch.nn.Module, fmt: WeightFormatConfig, side: Literal["trainer", "engine"], skip=("lm_head",)
) -> list[str]:
    """Make every linear layer of ``model`` but the LM head compute through ``fmt`` (in place).

    Returns:
        The module names changed.

    """
    cls = FakeQuantLinear if side == "trainer" else RoundedLinear
    names = []
    for name, module in _targets(model, skip):
        module.__class__ = cls
        module.weight_format = fmt
        if side == "engine":
            module.refresh()
        names.append(name)
    return names


__all__ = [
    "FakeQuantLinear",
    "RoundedLinear",
    "WeightFormatConfig",
    "apply_weight_format",
    "fake_quant",
    "fp8_blockwise",
    "fp8_dequantize",
    "int4_dequantize",
    "int4_groupwise",
    "quant_dequant",
]
