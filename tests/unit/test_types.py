"""The data types and the data-source contract: batch alignment, shards, prompt checks."""

import pytest
import torch

from miles_ray.types import RolloutBatch, Sample, check_prompt


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


@pytest.mark.parametrize(("num", "ranks"), [(3, 2), (17, 2), (1, 4), (5, 4), (8, 4)])
def test_uneven_shards_are_filled_with_rows_that_train_nothing(num, ranks):
    """A multi-turn rollout's sample count need not split over the ranks (17 over 2 crashed the tool-use example):
    every rank gets ceil(num / ranks) rows, filler rows (no trained token, advantage or reward) last; the shards'
    concatenation holds the samples first, in order, as ``gather_shards`` returns them."""
    samples = [Sample([1, 2], [10 + i, 20 + i], [-0.5, -1.5], reward=1.0 + i, group_id=i) for i in range(num)]
    b = RolloutBatch.from_samples(samples, pad_id=0, advantages=torch.arange(1.0, num + 1))
    shards = [b.shard(r, ranks) for r in range(ranks)]
    per = -(-num // ranks)
    assert [s.num_samples for s in shards] == [per] * ranks and sum(s.num_real for s in shards) == num
    whole = torch.cat([s.input_ids for s in shards])
    assert torch.equal(whole[:num], b.input_ids)
    filler = torch.cat([torch.zeros(s.num_samples, dtype=torch.bool) if s.filler is None else s.filler for s in shards])
    assert filler.tolist() == [False] * num + [True] * (per * ranks - num)
    for s in shards:
        if s.filler is not None:
            f = s.filler
            assert s.response_mask[f].sum() == 0 and s.advantages[f].abs().sum() == 0 and s.rewards[f].abs().sum() == 0
    values = torch.arange(num * 4.0).reshape(num, 4)
    rows = torch.cat([RolloutBatch.shard_rows(values, r, ranks) for r in range(ranks)])
    assert torch.equal(rows[:num], values) and rows[num:].abs().sum() == 0


class _Source:
    def __init__(self, prompt):
        self.prompt = prompt

    def next_prompt(self):
        return self.prompt

    def reward(self, text, entry):
        return 0.0


GOOD = {"prompt_ids": [1, 2], "entry": {}, "uid": 0, "messages": []}


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([1, 2], r"_Source.next_prompt\(\) must return a dict"),
        ({k: v for k, v in GOOD.items() if k != "uid"}, r"returned no 'uid'"),
        ({**GOOD, "entry": []}, r"\['entry'\] must be dict, got list"),
        ({**GOOD, "uid": True}, r"\['uid'\] must be int, got bool"),
        ({**GOOD, "prompt_ids": []}, r"non-empty list of token ids"),
        ({**GOOD, "prompt_ids": [1, -2]}, r"non-empty list of token ids"),
    ],
)
def test_data_source_contract_names_the_field(prompt, match):
    with pytest.raises(ValueError, match=match):
        check_prompt(prompt, _Source(prompt))


def test_first_trained_position_is_where_backends_start_forming_logits():
    s = Sample(prompt_ids=[1, 2, 3, 4], response_ids=[5], rollout_logprobs=[-1.0])
    t = Sample(prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[-1.0, -1.0], loss_mask=[0, 1])
    assert RolloutBatch.from_samples([s, t], pad_id=0).first_trained_position() == 2  # t's second response token
    untrained = Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-1.0], loss_mask=[0])
    assert RolloutBatch.from_samples([untrained], pad_id=0).first_trained_position() == 1  # none: the last position
