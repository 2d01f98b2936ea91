"""The RL step's batch stage (shaping and advantages) without a backend, and the step's shape over any backend."""

import pytest
import torch

from miles_ray.backends import ObjectiveConfig, OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import GAEAdvantageConfig
from miles_ray.backends.rl_step import RLStep
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import process_group  # noqa: F401  (module-scoped gloo group of one)


def _prepare(objective: ObjectiveConfig, samples: list[Sample], **kwargs):
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    returns, metrics = RLStep(None, objective).prepare(batch, samples, **kwargs)  # no backend needed: no KL
    return batch, returns, metrics


def test_overlong_penalty_shapes_rewards_before_advantages():
    samples = [
        Sample([1, 2], list(range(n)), [0.0] * n, reward=1.0, group_id=0) for n in (4, 8, 12)
    ]  # max 10, buffer 4: penalties 0, -0.5, -1
    batch, returns, metrics = _prepare(ObjectiveConfig(overlong_penalty={"max_len": 10, "buffer_len": 4}), samples)
    assert batch.rewards.tolist() == [1.0, 0.5, 0.0]
    assert batch.advantages[0] > batch.advantages[1] > batch.advantages[2]
    assert returns is None and metrics["shaped_reward_mean"] == pytest.approx(0.5)
    assert metrics["advantage_abs_mean"] == pytest.approx(float(batch.advantages.abs().mean()))


def test_gae_takes_the_critic_values_and_returns_value_targets():
    samples = [Sample([1, 2], [3, 4, 5], [0.0] * 3, reward=float(i), group_id=0) for i in range(2)]
    objective = ObjectiveConfig(advantage=GAEAdvantageConfig(gamma=1.0, lam=1.0, whiten=False))
    with pytest.raises(ValueError, match="needs the critic's values"):
        _prepare(objective, samples)
    values = torch.zeros(2, 4)
    batch, returns, _ = _prepare(objective, samples, values=values)
    # gamma = lambda = 1, zero values: every trained token's return (and advantage) is the sample's reward
    assert torch.equal(returns, batch.rewards[:, None] * batch.response_mask)
    assert torch.equal(batch.advantages, returns)


def test_kl_in_reward_mode_needs_a_reference(tiny_model_path):
    from miles_ray.backends.torch_backend import TorchBackend

    backend = TorchBackend(TorchBackendConfig(), OptimizerConfig(), tiny_model_path)  # no on-rank reference
    samples = [Sample([1, 2], [3, 4], [0.0] * 2, reward=float(i), group_id=0) for i in range(2)]
    step = RLStep(backend, ObjectiveConfig(kl={"coef": 0.1, "mode": "reward"}))
    with pytest.raises(RuntimeError, match="no reference model on this rank"):
        step.prepare(RolloutBatch.from_samples(samples, pad_id=0), samples)
    batch = RolloutBatch.from_samples(samples, pad_id=0)
    ref = torch.zeros_like(batch.response_mask)  # a ReferenceGroup's logprobs instead: log ref = 0
    _, metrics = step.prepare(batch, samples, ref_logprobs=ref)
    assert metrics["kl_reward_penalty_mean"] < 0  # log pi < 0 = log ref on every token: a negative k1 penalty
