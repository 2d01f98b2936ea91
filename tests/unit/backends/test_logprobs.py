"""Chunked token logprobs and entropies: the values and gradients of the obvious log-softmax expression."""

import pytest
import torch

from miles_ray.backends import logprobs as module
from miles_ray.backends.logprobs import token_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _grads(fn, logits, targets, temperature, w_lp, w_ent):
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = fn(x, targets, temperature)
    loss = 0.0
    if w_lp is not None:
        loss = loss + (lp * w_lp).sum()
    if w_ent is not None:
        loss = loss + (ent * w_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("terms", ["both", "logprobs", "entropy"])
def test_values_and_gradients_equal_the_log_softmax_expression_in_fp32(monkeypatch, temperature, terms):
    monkeypatch.setitem(module._CHUNK_ELEMENTS, "cpu", 3 * 50)  # chunks of 3 rows: 7 rows end in a partial chunk
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g, dtype=torch.float64).float() * 4
    targets = torch.randint(0, 50, (7,), generator=g)
    w_lp = torch.randn(7, generator=g) if terms != "entropy" else None
    w_ent = torch.randn(7, generator=g) if terms != "logprobs" else None
    got = _grads(token_logprobs, logits, targets, temperature, w_lp, w_ent)
    want = _grads(_reference, logits, targets, temperature, w_lp, w_ent)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got[2].abs().max() > 0.01  # the gradient is there, not zeros on both sides


def test_bf16_logits_give_fp32_results_and_a_bf16_gradient():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, 300, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 300, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g)
    lp, ent, grad = _grads(token_logprobs, logits, targets, 1.0, w, w)
    ref_lp, ref_ent, ref_grad = _grads(_reference, logits, targets, 1.0, w, w)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (2, 5) and grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-4)  # both rounded to bf16


def test_a_one_hot_distribution_has_zero_entropy_and_logprob():
    logits = torch.full((1, 10), -1e4)
    logits[0, 3] = 0.0
    lp, ent = token_logprobs(logits, torch.tensor([3]), 1.0)
    assert lp.item() == pytest.approx(0.0, abs=1e-6) and ent.item() == pytest.approx(0.0, abs=1e-6)
