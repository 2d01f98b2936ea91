import math

import pytest
import torch

from miles_ray.algo import (
    entropy_from_logits,
    gae_advantages,
    gspo_loss,
    importance_weights,
    kl_estimate,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)


def test_rloo_hand_computed():
    # group 0: 1, 0, 2 -> leave-one-out means 1, 1.5, 0.5; group 1 has one sample -> 0
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 2.0, 5.0]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 0.0]))


def test_gae_hand_computed_with_padding():
    # one sequence, tokens at t=0,1 (t=2 padding); reward 1 on the last token; V = [0.5, 0.25]
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    d1 = 1.0 - 0.25  # last token: next value 0
    d0 = 0.0 + 0.9 * 0.25 - 0.5
    a0 = d0 + 0.9 * 0.8 * d1
    torch.testing.assert_close(adv, torch.tensor([[a0, d1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, d1 + 0.25, 0.0]]))


def test_reinforce_pp_normalises_over_tokens():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, eps=0.0)
    # token rewards 1, 1, 0 -> mean 2/3, std sqrt(2/9)
    s = math.sqrt(2 / 9)
    torch.testing.assert_close(adv, torch.tensor([[(1 / 3) / s, (1 / 3) / s], [(-2 / 3) / s, 0.0]]))
    with_baseline = reinforce_pp_advantages(torch.tensor([1.0, 3.0]), torch.ones(2, 1), torch.tensor([0, 0]), eps=0.0)
    torch.testing.assert_close(with_baseline, torch.tensor([[-1.0], [1.0]]))


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -1.0]])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), torch.tensor([[0.5, 0.0]]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([[0.125, 0.0]]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.tensor([[math.exp(-0.5) - 1 + 0.5, 0.0]]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(lp, ref, "k4")


def test_entropy_uniform():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))


def test_dual_clip_caps_negative_advantage_loss():
    logprobs = torch.tensor([[math.log(5.0)]])  # ratio 5 on a token with A = -1
    plain, _ = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    dual, _ = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    assert plain.item() == pytest.approx(5.0) and dual.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=0.5)


def test_gspo_sequence_ratio_hand_computed():
    # sequence log ratio = mean(0.2, 0.0) = 0.1 -> ratio e^0.1 > 1 + 4e-4, A = 1 -> clipped at 1.0004
    logprobs = torch.tensor([[0.2, 0.0, 7.0]], requires_grad=True)
    loss, m = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0004) and m["clipfrac"] == 1.0
    loss2, m2 = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([-1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss2.item() == pytest.approx(math.exp(0.1)) and m2["clipfrac"] == 0.0  # A<0: unclipped is larger
    loss2.backward()
    assert logprobs.grad[0, 2].item() == 0.0  # masked token gets no gradient


def test_tis_and_mis_weights():
    train = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)]])
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    w, m = importance_weights(train, rollout, mask, "tis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.25]]))
    assert m["weight_clipped_frac"] == pytest.approx(1 / 3) and m["ratio_max"] == pytest.approx(3.0)
    w, m = importance_weights(train, rollout, mask, "mis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]]))
    assert m["mismatch_abs_max"] == pytest.approx(math.log(4.0))
    with pytest.raises(ValueError, match="cap must be > 1"):
        importance_weights(train, rollout, mask, cap=1.0)
