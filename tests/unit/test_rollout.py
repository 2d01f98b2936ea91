"""Contracts of the rollout-function and data-source extension points (real Ray object store, no engine needed)."""

import pytest
import ray

from miles_ray.engines.requests import SamplingParams
from miles_ray.rollout import RolloutFunctionConfig, generate_groups, request_id
from miles_ray.types import PROMPT_FIELDS, GroupRef, Sample, check_prompt

from .test_types import GOOD, _Source


def test_default_rollout_function_is_generate_groups():
    assert RolloutFunctionConfig().fn == "miles_ray.rollout:generate_groups"
    with pytest.raises(ValueError, match="rollout.fn"):
        RolloutFunctionConfig(fn="miles_ray.rollout:nope")


def test_custom_rollout_function_gets_its_kwargs_and_passes_group_refs_through(ray_cluster):
    calls = []

    def replay_offline(router, task, params, num_prompts, tag):  # e.g. samples from a file, no engine
        calls.append((router, task, params.n, num_prompts, tag))
        samples = [Sample([1, 2], [3], [-0.5], reward=1.0, group_id=i) for i in range(params.n)]
        return [GroupRef(ray.put(samples), len(samples), 0, i) for i in range(num_prompts)]

    rollout = RolloutFunctionConfig(fn=replay_offline, kwargs={"tag": "offline"}).resolve()
    groups = rollout("router", "task", SamplingParams(n=2), 3)
    assert calls == [("router", "task", 2, 3, "offline")]
    assert len(groups) == 3 and [len(g) for g in ray.get([g.ref for g in groups])] == [2, 2, 2]


def test_rollout_function_breaking_the_contract_is_a_clear_error(ray_cluster):
    def returns_samples(router, task, params, num_prompts):
        return [Sample([1], [2], [0.0])]

    with pytest.raises(TypeError, match=r"must return a list of GroupRef .*got \['Sample'\]"):
        RolloutFunctionConfig(fn=returns_samples).resolve()(None, None, SamplingParams(), 1)
    with pytest.raises(TypeError, match="got dict"):
        RolloutFunctionConfig(fn=lambda *a: {}).resolve()(None, None, SamplingParams(), 1)


def test_data_source_is_checked_before_anything_is_sent():
    """generate_groups validates every prompt before it calls the router (None here would fail otherwise)."""
    assert check_prompt(GOOD, _Source(GOOD)) is GOOD and set(PROMPT_FIELDS) <= set(GOOD)
    bad = {**GOOD, "prompt_ids": "hello"}
    with pytest.raises(ValueError, match=r"\['prompt_ids'\] must be list, got str"):
        generate_groups(None, _Source(bad), SamplingParams(), 1)


def test_uid_is_the_one_prompt_identity():
    """A prompt needs no dataset index; its request id is built from its uid (unique in a run, unlike an index)."""
    assert set(PROMPT_FIELDS) == {"prompt_ids", "entry", "uid"}
    assert request_id({**GOOD, "uid": 7, "index": 0}) == "p7"
