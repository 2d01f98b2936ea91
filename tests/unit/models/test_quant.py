"""FP8 blockwise and INT4 group-wise quantisers: format limits, tile independence, idempotence, the STE."""

import pytest
import torch

from miles_ray.models.quant import (
    FP8_MAX,
    WeightFormatConfig,
    apply_weight_format,
    fake_quant,
    fp8_blockwise,
    fp8_dequantize,
    int4_dequantize,
    int4_groupwise,
    quant_dequant,
)


def _w(rows=200, cols=130, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_fp8_tiles_scale_to_the_format_max_and_round_within_e4m3_precision():
    w = _w()
    q, scale_inv = fp8_blockwise(w, block=64)
    assert (
        q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale_inv.shape == (4, 3)
    )  # ceil(200/64), ceil(130/64)
    tile_max = q.float().abs()[:64, :64].max()
    assert tile_max == FP8_MAX  # each tile's largest magnitude lands on e4m3's largest finite value
    back = fp8_dequantize(q, scale_inv, 64)
    tile_scale = scale_inv.repeat_interleave(64, 0).repeat_interleave(64, 1)[:200, :130]
    big = w.abs() / tile_scale >= 2**-6  # e4m3's normal range (subnormals have coarser relative steps)
    rel = ((back - w).abs() / w.abs())[big]
    assert rel.max() <= 2**-4 + 1e-6  # 3 mantissa bits: half an ulp is 1/16 of the value at most
    torch.testing.assert_close(quant_dequant(back, "fp8", 64), back, rtol=1e-6, atol=0)  # on the grid: stays put


def test_fp8_tiles_are_independent():
    w = _w()
    loud = w.clone()
    loud[:64, :64] *= 1000  # one tile's outlier must not cost the other tiles precision
    a, b = quant_dequant(w, "fp8", 64), quant_dequant(loud, "fp8", 64)
    torch.testing.assert_close(a[64:], b[64:], rtol=0, atol=0)
    torch.testing.assert_close(a[:64, 64:], b[:64, 64:], rtol=0, atol=0)


def test_int4_codes_scales_and_error_bound():
    w = _w()
    codes, scales = int4_groupwise(w, group=32)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert scales.shape == (200, 5)  # ceil(130 / 32) groups per row
    back = int4_dequantize(codes, scales, 32)
    err = (back - w).abs()
    per_elem_scale = scales.repeat_interleave(32, 1)[:, :130]
    assert (err <= per_elem_scale / 2 + 1e-6).all()  # round to nearest step
    torch.testing.assert_close(quant_dequant(back, "int4", 32), back, rtol=1e-6, atol=0)
    assert len(torch.unique(codes[0, :32])) <= 16


def test_fake_quant_forward_is_quantised_and_backward_is_identity():
    w = _w().requires_grad_()
    g = torch.randn_like(w)
    for fmt in ("fp8", "int4"):
        w.grad = None
        out = fake_quant(w, fmt, 64)
        torch.testing.assert_close(out.detach(), quant_dequant(w.detach(), fmt, 64), rtol=0, atol=0)
        (out * g).sum().backward()
        torch.testing.assert_close(w.grad, g, rtol=0, atol=0)
    with pytest.raises(ValueError, match="format must be 'fp8' or 'int4'"):
        quant_dequant(w, "nf4")


def test_weight_format_keeps_the_lm_head():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(130, 200))
    model.add_module("lm_head", torch.nn.Linear(200, 50))
    head = model.lm_head.weight.detach().clone()
    assert apply_weight_format(model, WeightFormatConfig(format="int4", block=32), "engine") == ["proj"]
    assert type(model.lm_head) is torch.nn.Linear and torch.equal(model.lm_head.weight, head)
    w = model.proj.rounded
    torch.testing.assert_close(quant_dequant(w, "int4", 32), w, rtol=1e-6, atol=0)
