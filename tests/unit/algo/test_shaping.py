import pytest
import torch

from miles_ray.algo.shaping import has_reward_variance, overlong_penalty


def test_overlong_penalty_by_hand():
    # max 10, buffer 4: free up to 6, linear to -1 at 10, -1 beyond
    lengths = torch.tensor([3, 6, 7, 8, 10, 15])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=10, buffer_len=4), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5), expected * 0.5)
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(lengths, max_len=10, buffer_len=0)


def test_has_reward_variance_by_group():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])  # groups need not be contiguous ids
    # group 7 all 1 -> drop; group 3 {0, .5} -> keep; group 9 {.5, 1} -> keep; group 4 single -> drop
    assert has_reward_variance(rewards, groups).tolist() == [False, False, True, True, True, True, False]
