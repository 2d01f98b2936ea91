"""ReferenceGroup: the frozen reference policy as ranks of their own, serving logprobs for the KL terms.

The reference is the initial weights, never updated. By default ``TrainerGroupConfig.kl`` keeps a copy on
every trainer rank; a ``ReferenceGroup`` moves it into actors of its own (the plan's ``"reference"`` slots:
``placement.colocated(n, reference=True)`` shares the trainer's bundles, ``disaggregated(...,
num_reference_ranks=k)`` gives it bundles of its own), so its memory leaves the trainer and its forward
passes overlap with the critic's.

Usage::

    reference = ReferenceGroup.remote(ReferenceGroupConfig(model_path=p), pl)
    trainer = TrainerGroup.remote(TrainerGroupConfig(model_path=p, kl={"coef": 0.01}), pl, reference=reference)
"""

from __future__ import annotations

import ray
from pydantic import Field, field_validator

from miles_ray.actors.workers import Worker, start_workers
from miles_ray.backends import rl_step
from miles_ray.backends.torch_parallel import TorchBackendConfig, policy_only
from miles_ray.config import StrictConfig
from miles_ray.placement.groups import Placement


class ReferenceGroupConfig(StrictConfig):
    """The frozen reference: which weights, how many ranks, how they are held."""

    model_path: str = Field(..., description="HF model directory of the reference (usually the initial policy).")
    num_ranks: int = Field(1, ge=1, le=65536, description="Ranks (the plan's reference slots); FSDP2 shards over them.")
    backend: TorchBackendConfig = Field(
        default_factory=TorchBackendConfig, description="dtype, autocast, micro-batch size, sharding."
    )
    seed: int = Field(0, description="torch seed on every rank.")

    @field_validator("backend")
    @classmethod
    def _policy_only(cls, value: TorchBackendConfig) -> TorchBackendConfig:
        return policy_only(value, "ReferenceGroupConfig")


class ReferenceWorker(Worker):
    """One reference rank (apply ``ray.remote`` via ``ReferenceGroup``)."""

    def setup(self) -> None:
        """Load the frozen model (no optimizer, no gradients)."""
        from miles_ray.backends.torch_backend import PolicyModel

        self.backend = PolicyModel(self.config.backend, None, self.config.model_path)

    def compute_logprobs(self, group_refs: list, temperature: float) -> list[list[float]] | None:
        """Collective: every sample's trained-token logprobs under the reference (rank 0 returns them)."""
        batch, _ = self.batch(group_refs)
        shard = batch.shard(*self.data_shard)
        return self.gather_masked(batch, rl_step.logprobs(self.backend, shard, temperature))


@ray.remote(num_cpus=0)
class ReferenceGroup:
    """The driver-facing reference model."""

    def __init__(self, config: ReferenceGroupConfig, placement: Placement):
        self.config = config
        self._workers = start_workers(placement, ReferenceWorker, "reference", "ReferenceGroupConfig.num_ranks", config)

    def compute_logprobs(self, group_refs: list, temperature: float = 1.0) -> list[list[float]]:
        """Every sample's trained-token logprobs at ``temperature``, in the groups' order."""
        return ray.get([w.compute_logprobs.remote(group_refs, temperature) for w in self._workers])[0]
