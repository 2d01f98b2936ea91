"""PPO's pure pieces, hand-computed: terminal rewards, whitening, GAE targets with a KL penalty, value loss."""

import pytest
import torch

from miles_ray.algo import terminal_rewards, value_loss, whiten
from miles_ray.backends.objectives import GAEAdvantageConfig, compute_advantages, gae_targets


def test_terminal_reward_sits_on_the_last_trained_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]]  # a row without tokens gets nothing


def test_whiten_over_masked_tokens():
    x = torch.tensor([[1.0, 3.0, 99.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(whiten(x, m), torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_gae_targets_hand_computed_with_token_penalty():
    # one sample, 2 trained tokens, reward 1 on the last; values 0.5, 0.25; penalty 0.1 per token; gamma 1, lam 0.5
    mask = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.5, 0.25]])
    cfg = GAEAdvantageConfig(gamma=1.0, lam=0.5, whiten=False)
    adv, ret = gae_targets(cfg, torch.tensor([1.0]), values, mask, token_penalty=torch.full((1, 2), 0.1))
    # token rewards r = [-0.1, 0.9]; delta_1 = 0.9 - 0.25 = 0.65; delta_0 = -0.1 + 0.25 - 0.5 = -0.35
    # A_1 = 0.65; A_0 = -0.35 + 0.5 * 0.65 = -0.025; returns = A + V
    torch.testing.assert_close(adv, torch.tensor([[-0.025, 0.65]]))
    torch.testing.assert_close(ret, torch.tensor([[0.475, 0.9]]))
    whitened, ret_w = gae_targets(GAEAdvantageConfig(gamma=1.0, lam=0.5), torch.tensor([1.0]), values, mask)
    assert float(whitened.sum()) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(ret_w, torch.tensor([[0.625, 1.0]]))  # returns are never whitened


def test_gae_without_values_is_a_clear_error():
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(GAEAdvantageConfig(), torch.zeros(2), torch.zeros(2), torch.ones(2, 3))


def test_value_loss_hand_computed_with_clipping():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask, clip=None)
    assert float(loss) == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    # clip 0.5: token 0's value is clipped to 0.5, error 2.25 > 1 is taken; token 1 unchanged
    loss, m = value_loss(values, old, returns, mask, clip=0.5)
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.0) / 2) and m["value_clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="differ"):
        value_loss(values, old, returns, torch.ones(1, 3))
