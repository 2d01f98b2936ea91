"""CriticGroup: the PPO value model as N ranks of their own (FSDP2/DDP), beside the TrainerGroup.

Give it to the trainer and PPO runs inside ``TrainerGroup.train_step``: the critic's values go into GAE on
the trainer ranks, and the returns come back here as value targets. It takes the ``"critic"`` slots of
the placement plan (``placement.colocated(n, critic=True)`` shares the trainer's bundles).

Usage::

    critic = CriticGroup.remote(CriticGroupConfig(model_path=p, optimizer={"lr": 1e-5}), pl)
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=p, advantage={"kind": "gae"}), pl, critic=critic)
"""

from __future__ import annotations

import ray
import torch
from pydantic import Field, field_validator

from miles_ray.actors.workers import Worker, from_masked_lists, start_workers
from miles_ray.backends import rl_step
from miles_ray.backends.optimizer import OptimizerConfig
from miles_ray.backends.torch_parallel import TorchBackendConfig, policy_only
from miles_ray.config import StrictConfig
from miles_ray.placement.groups import Placement


class CriticGroupConfig(StrictConfig):
    """The critic: a value head on the policy's architecture, its own optimizer and ranks."""

    model_path: str = Field(..., description="HF model directory the critic's transformer starts from.")
    num_ranks: int = Field(1, ge=1, le=65536, description="Data-parallel critic ranks (the plan's critic slots).")
    backend: TorchBackendConfig = Field(default_factory=TorchBackendConfig, description="Training backend.")
    optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(lr=1e-5), description="Critic optimizer (AdamW)."
    )
    head_lr: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Learning rate of the zero-initialised value head (it starts from nothing while the "
        "transformer is pretrained); None uses optimizer.lr.",
    )
    value_clip: float | None = Field(
        0.2, gt=0.0, le=100.0, description="PPO value clipping around the rollout-time values; None disables."
    )
    seed: int = Field(0, description="torch seed on every rank.")

    @field_validator("backend")
    @classmethod
    def _policy_only(cls, value: TorchBackendConfig) -> TorchBackendConfig:
        return policy_only(value, "CriticGroupConfig")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over trained tokens: 1 is a perfect critic, <= 0 no better than a constant."""
    m = mask > 0
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / var) if r.numel() > 1 and var > 0 else float("nan")


class CriticWorker(Worker):
    """One critic rank (apply ``ray.remote`` via ``CriticGroup``)."""

    def setup(self) -> None:
        """Build the value model and its optimizer."""
        from miles_ray.backends.critic import TorchCriticBackend

        c = self.config
        self.backend = TorchCriticBackend(c.backend, c.optimizer, c.model_path, c.head_lr)

    def compute_values(self, group_refs: list) -> list[list[float]] | None:
        """Collective: every sample's values on its trained tokens (rank 0 returns them)."""
        batch, _ = self.batch(group_refs)
        return self.gather_masked(batch, rl_step.critic_values(self.backend, batch.shard(*self.data_shard)))

    def train_step(self, group_refs: list, values: list[list[float]], returns: list[list[float]]) -> dict:
        """One optimizer step towards ``returns`` (clipped around ``values``) on this rank's shard."""
        batch, _ = self.batch(group_refs)
        mask = batch.response_mask
        old = from_masked_lists(values, mask, "values")
        target = from_masked_lists(returns, mask, "returns")
        shard, dp = batch.shard(*self.data_shard), self.data_shard
        old_shard, target_shard = batch.shard_rows(old, *dp), batch.shard_rows(target, *dp)
        metrics = rl_step.value_update(self.backend, shard, old_shard, target_shard, self.config.value_clip)
        metrics["explained_variance"] = explained_variance(old, target, mask)
        return metrics

    def save(self, path: str) -> None:
        """Collective checkpoint save (torch DCP)."""
        self.backend.save(path)

    def load(self, path: str) -> None:
        """Collective checkpoint load."""
        self.backend.load(path)


@ray.remote(num_cpus=0)
class CriticGroup:
    """The driver-facing critic: values for GAE and one optimizer step per trainer step."""

    def __init__(self, config: CriticGroupConfig, placement: Placement):
        self.config = config
        self._workers = start_workers(placement, CriticWorker, "critic", "CriticGroupConfig.num_ranks", config)

    def compute_values(self, group_refs: list) -> list[list[float]]:
        """Every sample's values on its trained tokens, in the groups' order."""
        return ray.get([w.compute_values.remote(group_refs) for w in self._workers])[0]

    def train_step(self, group_refs: list, values: list[list[float]], returns: list[list[float]]) -> dict:
        """One critic optimizer step; ``explained_variance`` is of the values the returns were computed with."""
        return ray.get([w.train_step.remote(group_refs, values, returns) for w in self._workers])[0]

    def save(self, path: str) -> None:
        """Checkpoint the critic (model + optimizer, torch DCP) into directory ``path``."""
        ray.get([w.save.remote(path) for w in self._workers])

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any rank count)."""
        ray.get([w.load.remote(path) for w in self._workers])
