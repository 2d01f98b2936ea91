import pytest
import torch

from miles_ray.types import RolloutBatch, Sample


def test_rollout_batch_alignment():
    s = Sample(prompt_ids=[10, 11, 12], response_ids=[20, 21], rollout_logprobs=[-0.1, -0.2], reward=1.0, group_id=3)
    t = Sample(prompt_ids=[10], response_ids=[30, 31, 32], rollout_logprobs=[-1.0, -2.0, -3.0], loss_mask=[1, 0, 1])
    b = RolloutBatch.from_samples([s, t], pad_id=0)
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 30, 31, 32, 0]]
    # logprob index t predicts token t+1: response of s sits at indices 2, 3
    assert b.response_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert b.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert b.rollout_logprobs[1].tolist() == pytest.approx([-1.0, -2.0, -3.0, 0])
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert torch.equal(b.rewards, torch.tensor([1.0, 0.0]))
    shard = b.shard(1, 2)
    assert shard.input_ids.tolist() == [[10, 30, 31, 32, 0]]


def test_sample_length_mismatch_is_rejected():
    with pytest.raises(ValueError, match="same length"):
        Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1.0])


def test_uneven_shard_is_rejected():
    s = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        RolloutBatch.from_samples([s, s, s], pad_id=0).shard(0, 2)
