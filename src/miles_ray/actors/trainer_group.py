"""TrainerGroup: N trainer ranks as Ray actors forming one ``torch.distributed`` group (gloo on CPU, NCCL on GPU).

``TrainerGroup`` is the actor a driver talks to; it creates one ``TrainerWorker`` per trainer slot of the
placement plan and fans calls out to all of them (every call is collective). Each worker fetches the
sample groups it is given from the object store, computes advantages, trains on its shard.
The group owns the weight version: it goes up by one with every optimizer step.

Usage::

    trainer = TrainerGroup.options(name="miles_ray/trainer").remote(TrainerGroupConfig(model_path=p), placement)
    metrics = ray.get(trainer.train_step.remote(group_refs))
"""

from __future__ import annotations

import json
import os
import socket
from typing import Literal

import ray
import torch
from pydantic import Field, model_validator

from miles_ray.algo.shaping import overlong_penalty
from miles_ray.backends.base import OptimizerConfig, TorchBackendConfig
from miles_ray.backends.objectives import (
    AdvantageConfig,
    GRPOAdvantageConfig,
    KLConfig,
    LossConfig,
    MismatchCorrectionConfig,
    OverlongPenaltyConfig,
    PPOClipLossConfig,
    compute_advantages,
)
from miles_ray.config import StrictConfig
from miles_ray.hooks import HookContext, Hooks, TrainerHooksConfig
from miles_ray.placement.groups import Placement
from miles_ray.sync.checksum import buckets_checksum
from miles_ray.sync.plan import SyncPlan
from miles_ray.types import RolloutBatch, Sample


class TrainerGroupConfig(StrictConfig):
    """The trainer: model, parallelism, optimizer, loss and advantages."""

    model_path: str = Field(..., description="HF model directory the policy starts from.")
    num_ranks: int = Field(1, ge=1, le=65536, description="Data-parallel trainer ranks.")
    backend: TorchBackendConfig = Field(default_factory=TorchBackendConfig, description="Training backend.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer settings.")
    loss: LossConfig = Field(default_factory=PPOClipLossConfig, description="Policy loss (ppo_clip | gspo).")
    advantage: AdvantageConfig = Field(
        default_factory=GRPOAdvantageConfig, description="Advantage estimator (grpo | rloo | reinforce_pp)."
    )
    mismatch_correction: MismatchCorrectionConfig | None = Field(
        None, description="TIS/MIS weights from the engine's logprobs (ppo_clip loss only); None disables."
    )
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0, description="Entropy bonus coefficient (0: logged only).")
    kl: KLConfig | None = Field(
        None, description="KL to a frozen reference model (the initial weights), as loss or reward; None disables."
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="DAPO soft overlong penalty added to rewards before advantages; None disables."
    )
    temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Rollout sampling temperature; the trainer's logits are divided by it."
    )
    old_logprobs: Literal["current", "rollout"] = Field(
        "current",
        description="Behaviour logprobs in the PPO ratio: the current policy's (exact for one step per batch) or "
        "the engine's rollout logprobs.",
    )
    hooks: TrainerHooksConfig = Field(
        default_factory=TrainerHooksConfig, description="User callables run on every rank at fixed points."
    )
    seed: int = Field(0, description="torch seed on every rank.")

    @model_validator(mode="after")
    def _check_correction(self) -> TrainerGroupConfig:
        if self.mismatch_correction is not None and self.loss.kind != "ppo_clip":
            raise ValueError(
                f"mismatch_correction needs loss.kind='ppo_clip' (per-token weights), got loss.kind={self.loss.kind!r}"
            )
        return self


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fetch_samples(group_refs: list) -> list[Sample]:
    return [s for group in ray.get([g.ref for g in group_refs]) for s in group]


class TrainerWorker:
    """One trainer rank (apply ``ray.remote`` via ``TrainerGroup``)."""

    def __init__(self, rank: int, world_size: int, config: TrainerGroupConfig):
        self.rank, self.world_size, self.config = rank, world_size, config
        self.backend = None
        self._sync_group = None

    def address(self) -> tuple[str, int]:
        """Node IP and a free port, for rendezvous hosted by this rank."""
        return ray.util.get_node_ip_address(), _free_port()

    def init(self, master_addr: str, master_port: int) -> None:
        """Join the data-parallel group and build the backend (model + optimizer)."""
        import torch.distributed as dist

        from miles_ray.backends.torch_backend import TorchBackend

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        torch.manual_seed(self.config.seed)
        c = self.config
        self.backend = TorchBackend(
            c.backend,
            c.optimizer,
            c.loss,
            c.model_path,
            correction=c.mismatch_correction,
            entropy_coef=c.entropy_coef,
            kl=c.kl,
        )
        self.hooks = Hooks(c.hooks)
        self.ctx = HookContext(self.rank, self.world_size, self.backend.model, self.backend.optimizer, c)
        self.hooks.call("after_init", self.ctx)

    def _batch(self, group_refs: list, pad_id: int = 0) -> tuple[RolloutBatch, list[Sample]]:
        samples = _fetch_samples(group_refs)
        batch = RolloutBatch.from_samples(samples, pad_id)
        if self.config.overlong_penalty is not None:
            c = self.config.overlong_penalty
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            batch.rewards = batch.rewards + overlong_penalty(lengths, c.max_len, c.buffer_len, c.penalty_factor)
        self._advantages(batch, samples)
        return batch, samples

    def _advantages(self, batch: RolloutBatch, samples: list[Sample]) -> None:
        group_ids = torch.tensor([s.group_id for s in samples])
        batch.advantages = compute_advantages(self.config.advantage, batch.rewards, group_ids, batch.response_mask)

    def _all_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``local`` tensor in rank order (the shards are contiguous slices)."""
        import torch.distributed as dist

        parts = [None] * self.world_size
        dist.all_gather_object(parts, local)
        return torch.cat(parts)

    def train_step(self, group_refs: list) -> dict[str, float]:
        """Train one optimizer step on this rank's shard of the groups' samples."""
        batch, samples = self._batch(group_refs)
        kl_penalty = None
        if self.config.kl is not None and self.config.kl.mode == "reward":  # before advantages, on the full batch
            seq_kl = self.backend.sequence_kl(batch.shard(self.rank, self.world_size), self.config.temperature)
            kl_penalty = self.config.kl.coef * self._all_ranks(seq_kl)
            batch.rewards = batch.rewards - kl_penalty
            self._advantages(batch, samples)
        shard = batch.shard(self.rank, self.world_size)
        self.hooks.call("before_train_step", self.ctx, shard)
        old = shard.rollout_logprobs if self.config.old_logprobs == "rollout" else None
        metrics = self.backend.train_step(shard, self.config.temperature, old_logprobs=old)
        metrics["advantage_abs_mean"] = float(batch.advantages.abs().mean())
        metrics["shaped_reward_mean"] = float(batch.rewards.mean())
        if kl_penalty is not None:
            metrics["kl_reward_penalty_mean"] = float(kl_penalty.mean())
        metrics.update(self.hooks.call("after_train_step", self.ctx, metrics))
        return metrics

    def compute_logprobs(self, group_refs: list) -> list[list[float]] | None:
        """Every sample's response-token logprobs under the current weights (rank 0 returns them)."""
        batch, samples = self._batch(group_refs)
        shard = batch.shard(self.rank, self.world_size)
        self.hooks.call("before_logprobs", self.ctx, shard)
        full = self._all_ranks(self.backend.compute_logprobs(shard, self.config.temperature))
        if self.rank != 0:
            return None
        return [full[i][batch.response_mask[i] > 0].tolist() for i in range(len(samples))]

    # --- weight sync ----------------------------------------------------------------------------
    def sync_plan(self, dtype: str, bucket_bytes: int) -> SyncPlan:
        """The bucket plan of this model's parameters in ``dtype``."""
        return self.backend.sync_plan(getattr(torch, dtype), bucket_bytes)

    def join_sync_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0 joins the weight-broadcast group as its root."""
        from miles_ray.sync.gloo import BroadcastGroup

        self._sync_group = BroadcastGroup.create(host, port, 0, world_size, backend)

    def _gather(self, plan: SyncPlan):
        for bucket in plan.buckets:
            yield bucket, self.backend.gather_bucket(bucket, bucket.dtype)

    def broadcast_weights(self, plan: SyncPlan, verify: bool) -> str | None:
        """Collective: gather each bucket; rank 0 broadcasts it. Returns rank 0's checksum if ``verify``."""
        sent = []
        for _, flat in self._gather(plan):
            if self.rank == 0:
                self._sync_group.broadcast(flat)
                if verify:
                    sent.append(flat)
        return buckets_checksum(plan, sent) if self.rank == 0 and verify else None

    def put_weight_buckets(self, plan: SyncPlan) -> list | None:
        """Collective: gather each bucket; rank 0 puts it in the object store and returns the refs."""
        from miles_ray.sync.shm import put_bucket

        refs = [put_bucket(flat) for _, flat in self._gather(plan) if self.rank == 0]
        return refs if self.rank == 0 else None

    def save(self, path: str) -> None:
        """Collective checkpoint save."""
        self.backend.save(path)
        self.hooks.call("after_save", self.ctx, path)

    def load(self, path: str) -> None:
        """Collective checkpoint load."""
        self.backend.load(path)


@ray.remote(num_cpus=0)
class TrainerGroup:
    """The driver-facing trainer: owns the rank actors and the weight version."""

    def __init__(self, config: TrainerGroupConfig, placement: Placement):
        self.config = config
        n = config.num_ranks
        self._workers = placement.spawn(
            TrainerWorker, "trainer", "TrainerGroupConfig.num_ranks", n, lambda rank: (rank, n, config)
        )
        addr, port = ray.get(self._workers[0].address.remote())
        ray.get([w.init.remote(addr, port) for w in self._workers])
        self._version = 0

    def workers(self) -> list:
        """Rank actor handles, rank order (the WeightBroadcaster drives them directly)."""
        return list(self._workers)

    def weight_version(self) -> int:
        """Number of optimizer steps taken (the version engines should hold after a sync)."""
        return self._version

    def train_step(self, group_refs: list) -> dict[str, float]:
        """One optimizer step on all ranks over the given sample groups; returns metrics and the new version."""
        metrics = ray.get([w.train_step.remote(group_refs) for w in self._workers])[0]
        self._version += 1
        metrics["weight_version"] = self._version
        return metrics

    def compute_logprobs(self, group_refs: list) -> list[list[float]]:
        """Response-token logprobs of every sample (in the groups' order) under the current weights."""
        return ray.get([w.compute_logprobs.remote(group_refs) for w in self._workers])[0]

    def save(self, path: str) -> None:
        """Checkpoint model and optimizer (torch DCP) and the weight version into directory ``path``."""
        ray.get([w.save.remote(path) for w in self._workers])
        with open(os.path.join(path, "miles_ray_trainer.json"), "w") as f:
            json.dump({"weight_version": self._version, "num_ranks": len(self._workers)}, f)

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any rank count); restores the weight version."""
        ray.get([w.load.remote(path) for w in self._workers])
        with open(os.path.join(path, "miles_ray_trainer.json")) as f:
            self._version = json.load(f)["weight_version"]
