"""Names of earlier releases keep working, each with a DeprecationWarning that names its replacement."""

import importlib

import pytest

from miles_ray.actors.async_rollout import AsyncRollout, AsyncRolloutConfig
from miles_ray.actors.embedded_engine import EmbeddedEngineActor
from miles_ray.callables import resolve_callable
from miles_ray.types import PROMPT_FIELDS, GroupRef, check_prompt


@pytest.mark.parametrize(
    ("module", "old", "new", "replacement"),
    [
        ("miles_ray", "RolloutWorker", AsyncRollout, "miles_ray.actors.async_rollout.AsyncRollout"),
        ("miles_ray", "RolloutWorkerConfig", AsyncRolloutConfig, "AsyncRolloutConfig"),
        ("miles_ray.actors", "RolloutWorker", AsyncRollout, "AsyncRollout"),
        ("miles_ray.actors", "RolloutWorkerConfig", AsyncRolloutConfig, "AsyncRolloutConfig"),
        ("miles_ray.actors", "EngineActor", EmbeddedEngineActor, "embedded_engine.EmbeddedEngineActor"),
        ("miles_ray.actors", "GroupRef", GroupRef, "miles_ray.types.GroupRef"),
        ("miles_ray.actors.replay_buffer", "GroupRef", GroupRef, "miles_ray.types.GroupRef"),
        ("miles_ray.rollout", "check_prompt", check_prompt, "miles_ray.types.check_prompt"),
        ("miles_ray.rollout", "PROMPT_FIELDS", PROMPT_FIELDS, "miles_ray.types.PROMPT_FIELDS"),
        ("miles_ray.rewards.safe", "resolve_callable", resolve_callable, "miles_ray.callables.resolve_callable"),
    ],
)
def test_old_name_resolves_to_the_new_one_and_warns(module, old, new, replacement):
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated: use .*{replacement}"):
        got = getattr(importlib.import_module(module), old)
    assert got is new
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        importlib.import_module(module).NoSuchName  # noqa: B018


def test_from_import_of_an_old_name_warns():
    with pytest.warns(DeprecationWarning, match="use miles_ray.types.GroupRef"):
        from miles_ray.actors.replay_buffer import GroupRef as Old
    assert Old is GroupRef


def test_broadcaster_backend_field_is_now_collective():
    from pydantic import ValidationError

    from miles_ray.actors import WeightBroadcasterConfig

    with pytest.warns(DeprecationWarning, match="WeightBroadcasterConfig.backend is deprecated: use collective"):
        config = WeightBroadcasterConfig(backend="gloo")
    assert config.collective == "gloo" and "backend" not in WeightBroadcasterConfig.model_fields
    with pytest.warns(DeprecationWarning), pytest.raises(ValidationError, match="give collective only"):
        WeightBroadcasterConfig(backend="gloo", collective="nccl")


def test_checkpointer_rollout_worker_keyword_is_now_async_rollout(tmp_path):
    from miles_ray.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(tmp_path)
    with pytest.warns(DeprecationWarning, match="rollout_worker= is deprecated: use async_rollout="):
        with pytest.raises(ValueError, match="give async_rollout .* or data_source .*, not both"):
            ckpt.save(0, trainer=None, rollout_worker=object(), data_source=object())
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="give async_rollout only"):
        ckpt.save(0, trainer=None, rollout_worker=object(), async_rollout=object())
