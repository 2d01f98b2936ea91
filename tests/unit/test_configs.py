"""Every config rejects bad input with an error that names the field."""

import pytest
from pydantic import ValidationError

from miles_ray.actors import (
    AsyncRolloutConfig,
    ReplayBufferConfig,
    RolloutPoolConfig,
    RouterConfig,
    TrainerGroupConfig,
    WeightBroadcasterConfig,
)
from miles_ray.backends import OptimizerConfig, PPOClipLossConfig, TorchBackendConfig
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.engines.requests import SamplingParams
from miles_ray.rewards import ReasoningGymTaskConfig


@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (SamplingParams, {"temperature": -1}, "temperature"),
        (SamplingParams, {"top_p": 0}, "top_p"),
        (SamplingParams, {"top_k": 0}, "top_k"),
        (SamplingParams, {"n": 0}, "n"),
        (SamplingParams, {"stop": ["</answer>", ""]}, "stop"),
        (EmbeddedEngineConfig, {"model_path": "x", "dtype": "int8"}, "dtype"),
        (EmbeddedEngineConfig, {"model_path": "x", "max_batch_size": 0}, "max_batch_size"),
        (RouterConfig, {"policy": "random"}, "policy"),
        (ReplayBufferConfig, {"max_staleness": -1}, "max_staleness"),
        (WeightBroadcasterConfig, {"transport": "carrier_pigeon"}, "transport"),
        (WeightBroadcasterConfig, {"bucket_bytes": 0}, "bucket_bytes"),
        (OptimizerConfig, {"lr": 0}, "lr"),
        (OptimizerConfig, {"betas": (0.9, 1.0)}, "betas"),
        (PPOClipLossConfig, {"aggregation": "mean"}, "aggregation"),
        (TorchBackendConfig, {"parallel": "zero3"}, "parallel"),
        (TrainerGroupConfig, {"model_path": "x", "num_ranks": 0}, "num_ranks"),
        (TrainerGroupConfig, {"model_path": "x", "old_logprobs": "stale"}, "old_logprobs"),
        (ReasoningGymTaskConfig, {"size": 0}, "size"),
        (WeightBroadcasterConfig, {"in_flight": "drop"}, "in_flight"),
        (AsyncRolloutConfig, {"prompts_in_flight": 0}, "prompts_in_flight"),
        (AsyncRolloutConfig, {"max_buffered_groups": 0}, "max_buffered_groups"),
        (TrainerGroupConfig, {"model_path": "x", "profile": {"steps": [], "out_dir": "t"}}, "profile.steps"),
        (PPOClipLossConfig, {"dual_clip": 1.0}, "dual_clip"),
        (TrainerGroupConfig, {"model_path": "x", "loss": {"kind": "gspo"}, "mismatch_correction": {}}, "ppo_clip"),
        (TrainerGroupConfig, {"model_path": "x", "mismatch_correction": {"cap": 1.0}}, "cap"),
        (TrainerGroupConfig, {"model_path": "x", "entropy_coef": -1}, "entropy_coef"),
        (TrainerGroupConfig, {"model_path": "x", "advantage": {"kind": "vtrace"}}, "advantage"),
        (TrainerGroupConfig, {"model_path": "x", "loss": {"kind": "gspo", "aggregation": "token_mean"}}, "aggregation"),
        (TrainerGroupConfig, {"model_path": "x", "kl": {"coef": 0.1, "mode": "advantage"}}, "mode"),
        (TrainerGroupConfig, {"model_path": "x", "kl": {"coef": -1}}, "coef"),
        (TrainerGroupConfig, {"model_path": "x", "overlong_penalty": {"max_len": 8, "buffer_len": 9}}, "buffer_len"),
        (EmbeddedEngineConfig, {"model_path": "x", "kv_cache_memory_gb": 0}, "kv_cache_memory_gb"),
    ],
)
def test_bad_value_names_the_field(cls, kwargs, field):
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    assert field in str(info.value)


@pytest.mark.parametrize("cls", [RouterConfig, ReplayBufferConfig, WeightBroadcasterConfig, OptimizerConfig])
def test_unknown_field_is_rejected(cls):
    with pytest.raises(ValidationError, match="lerning_rate"):
        cls(lerning_rate=1)


def test_nested_error_names_the_path():
    with pytest.raises(ValidationError, match=r"optimizer\.lr"):
        TrainerGroupConfig(model_path="x", optimizer={"lr": -1})
    with pytest.raises(ValidationError, match=r"engine\.num_threads"):
        RolloutPoolConfig(engine={"model_path": "x", "num_threads": 0})


def test_every_field_is_described():
    for cls in [
        SamplingParams,
        EmbeddedEngineConfig,
        RouterConfig,
        ReplayBufferConfig,
        WeightBroadcasterConfig,
        OptimizerConfig,
        PPOClipLossConfig,
        TorchBackendConfig,
        TrainerGroupConfig,
        RolloutPoolConfig,
        ReasoningGymTaskConfig,
        AsyncRolloutConfig,
    ]:
        for name, f in cls.model_fields.items():
            if name != "kind":
                assert f.description, f"{cls.__name__}.{name} has no description"


def test_objectives_are_discriminated_unions():
    cfg = TrainerGroupConfig(model_path="x", advantage={"kind": "rloo"}, loss={"kind": "gspo", "clip_high": 1e-3})
    assert type(cfg.advantage).__name__ == "RLOOAdvantageConfig"
    assert type(cfg.loss).__name__ == "GSPOLossConfig" and cfg.loss.clip_high == 1e-3
    assert TrainerGroupConfig(model_path="x").loss.kind == "ppo_clip"
