import math

import pytest
import torch

from miles_ray.algo import grpo_advantages


def test_grpo_hand_computed():
    # group 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5); group 1: 2, 2, 5 -> mean 3, std sqrt(3)
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 7, 7, 7])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    s0, s1 = math.sqrt(0.5), math.sqrt(3.0)
    expected = torch.tensor([0.5 / s0, -0.5 / s0, -1 / s1, -1 / s1, 2 / s1])
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_no_std_and_noncontiguous_groups():
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0])
    groups = torch.tensor([1, 2, 1, 2])
    adv = grpo_advantages(rewards, groups, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, -0.5, 1.0]))


def test_zero_variance_group_gets_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3))


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="rewards and group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
