"""The critic backend in-process (world size 1, gloo): value head, value loss steps, micro-batch invariance."""

import pytest
import torch

from miles_ray.backends import OptimizerConfig, TorchBackendConfig
from miles_ray.backends.critic import TorchCriticBackend
from miles_ray.backends.rl_step import critic_values, value_update
from miles_ray.types import RolloutBatch, Sample

from .test_torch_backend import process_group  # noqa: F401  (module-scoped gloo group of one)


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(8):
        prompt = torch.randint(10, 500, (3 + i % 3,), generator=g).tolist()
        resp = torch.randint(10, 500, (2 + i % 4,), generator=g).tolist()
        samples.append(Sample(prompt, resp, [0.0] * len(resp), reward=float(i % 2)))
    return RolloutBatch.from_samples(samples, pad_id=0)


def _params(critic):
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in critic.hf_model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in full])


def test_values_start_at_zero_and_move_towards_the_returns(tiny_model_path):
    critic = TorchCriticBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-3), tiny_model_path)
    batch = _batch()
    values = critic_values(critic, batch)
    assert values.shape == batch.response_mask.shape and (values == 0).all()  # zero-initialised head
    returns = batch.rewards[:, None] * batch.response_mask  # Monte-Carlo return of a terminal reward, gamma 1
    losses = [value_update(critic, batch, values, returns, value_clip=None)["value_loss"] for _ in range(8)]
    # at V = 0 the loss is 0.5 * mean(R^2) over trained tokens
    expected = 0.5 * float((returns**2 * batch.response_mask).sum() / batch.response_mask.sum())
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    after = critic_values(critic, batch)
    assert (after[batch.response_mask == 0] == 0).all()
    mask = batch.response_mask > 0
    assert ((after[mask] - returns[mask]) ** 2).mean() < ((values[mask] - returns[mask]) ** 2).mean()


def test_value_clip_limits_the_first_step(tiny_model_path):
    """With a tiny clip every token's clipped error is the larger one once values move: clipfrac > 0."""
    critic = TorchCriticBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-2), tiny_model_path)
    batch = _batch()
    old = critic_values(critic, batch)
    returns = (batch.rewards[:, None] + 1.0) * batch.response_mask
    first = value_update(critic, batch, old, returns, value_clip=1e-4)
    assert first["value_clipfrac"] == 0.0  # values == old_values on the first step: nothing clipped yet
    second = value_update(critic, batch, old, returns, value_clip=1e-4)
    assert second["value_clipfrac"] > 0.0


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_critic_micro_batching_does_not_change_the_update(tiny_model_path, parallel):
    results = []
    batch = _batch()
    returns = batch.rewards[:, None] * batch.response_mask
    for mbs in (8, 2):
        torch.manual_seed(0)
        config = TorchBackendConfig(parallel=parallel, micro_batch_size=mbs)
        critic = TorchCriticBackend(config, OptimizerConfig(lr=1e-3), tiny_model_path)
        before = _params(critic)
        m = value_update(critic, batch, torch.zeros_like(returns), returns, value_clip=0.2)
        results.append((m["value_loss"], _params(critic) - before))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-4)


def test_head_lr_gives_the_value_head_its_own_learning_rate(tiny_model_path):
    critic = TorchCriticBackend(TorchBackendConfig(), OptimizerConfig(lr=1e-5), tiny_model_path, head_lr=1e-2)
    groups = critic.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-5, 1e-2] and len(groups[1]["params"]) == 2  # head weight and bias
    batch = _batch()
    returns = batch.rewards[:, None] * batch.response_mask
    value_update(critic, batch, torch.zeros_like(returns), returns, value_clip=0.2)
    head = critic.hf_model.value_head.weight
    head = (head.full_tensor() if hasattr(head, "full_tensor") else head).detach()
    assert float(head.abs().max()) == pytest.approx(1e-2, rel=1e-3)  # Adam's first step moves each weight by lr


def test_the_weight_copy_gives_the_critic_autocast_s_values_and_updates_exactly(tiny_model_path):
    """bf16 autocast on a DDP rank: with and without the bf16 weight copy, the same values and weights bit for bit."""
    batch = _batch()
    returns = batch.rewards[:, None] * batch.response_mask
    runs = []
    for weight_copy in (False, True):
        torch.manual_seed(0)
        config = TorchBackendConfig(parallel="ddp", autocast="bfloat16", weight_copy=weight_copy, micro_batch_size=3)
        critic = TorchCriticBackend(config, OptimizerConfig(lr=1e-2), tiny_model_path)
        assert (critic.weight_copy is not None) == weight_copy
        losses = [value_update(critic, batch, torch.zeros_like(returns), returns, None)["value_loss"] for _ in range(2)]
        runs.append((losses, critic_values(critic, batch), _params(critic)))
    (l0, v0, p0), (l1, v1, p1) = runs
    assert l0 == l1 and l0[1] != l0[0] and (v0 != 0).any()  # the second update saw the first's weights
    assert torch.equal(v0, v1) and torch.equal(p0, p1)
