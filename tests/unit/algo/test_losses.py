import math

import pytest
import torch

from miles_ray.algo import masked_aggregate, ppo_clip_loss


def test_masked_aggregate_modes_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_aggregate(values, mask, "token_mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert masked_aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert masked_aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx((3 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        masked_aggregate(values, mask, "bogus")


def test_ppo_clip_hand_computed():
    # token 0: ratio e^0.5=1.6487, A=+1 -> clipped at 1.2 -> loss -1.2 (clipped)
    # token 1: ratio e^-0.5=0.6065, A=+1 -> min(0.6065, 0.8) = 0.6065 -> loss -0.6065 (not clipped)
    # token 2: ratio 1, A=-2 -> loss 2
    logprobs = torch.tensor([[0.5, -0.5, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, m = ppo_clip_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    expected = (-1.2 - math.exp(-0.5) + 2.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clipfrac"] == pytest.approx(1 / 3)
    k3 = [math.exp(-x) - 1 + x for x in (0.5, -0.5, 0.0)]
    assert m["approx_kl"] == pytest.approx(sum(k3) / 3, rel=1e-6)


def test_ppo_clip_higher_and_gradient():
    logprobs = torch.tensor([[0.22]], requires_grad=True)  # ratio 1.246: clipped at 0.2, not at 0.28
    loss, m = ppo_clip_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.28
    )
    assert loss.item() == pytest.approx(-math.exp(0.22), rel=1e-6)  # inside the higher clip: not clipped
    assert m["clipfrac"] == 0.0
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-math.exp(0.22), rel=1e-6)


def test_masked_tokens_do_not_contribute():
    logprobs = torch.tensor([[0.0, 100.0]])
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0)
