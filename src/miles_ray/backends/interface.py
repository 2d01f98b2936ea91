"""The primitives a backend gives the RL step (``backends.rl_step``), as Protocols.

A backend holds one rank of a model and knows how to run it: devices, parallel wrapping, the optimizer,
checkpoints, its data-parallel group. It knows nothing of rewards, advantages or losses: the RL step drives
these primitives, the same for every backend::

    LogprobModel        micro_batches(batch) -> row sets, train(mode), micro_batch(batch) -> context,
                        forward_logprobs(batch, temperature) -> (logprobs, entropy)
    StepPrimitives      device, dp_rank, dp_size, model, optimizer,
                        grad_sync(enabled), backward(loss, units, total_units), clip_and_step(loss_sum),
                        global_sum(values), global_max(value), gather_shards(local), save(path), load(path)
    TrainBackend        LogprobModel + StepPrimitives + reference, route_counts(),
                        forward_backward(batches, temperature, loss_of, total_units) -> stats per micro-batch,
                        sync_plan(dtype, bucket_bytes), gather_bucket(bucket, dtype), bucket_in_place(bucket),
                        publish_in_place(dtype, make_buffer), hf_state(dtype)
    CriticBackend       StepPrimitives + micro_batches(batch), train(mode), forward_values(batch)

Implementations: ``TorchBackend`` and ``MegatronBackend`` (``TrainBackend``), ``TorchCriticBackend``
(``CriticBackend``), a frozen ``PolicyModel`` (``LogprobModel``, the KL reference). ``miles_ray.contracts``
checks them (``tests/unit/backends/test_interface.py``).

Shapes: ``B`` samples of a micro-batch, ``T`` its padded length; per-token tensors are ``[B, T-1]``, aligned with
next-token logprobs (``logprobs[:, t]`` is the log-probability of ``input_ids[:, t+1]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from miles_ray.sync.buckets import Bucket, SyncPlan
from miles_ray.types import RolloutBatch


class LogprobModel(Protocol):
    """A model that scores tokens: the policy, or its frozen KL reference."""

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The batch's rows cut into micro-batches (``LongTensor`` each), by samples and tokens per forward."""
        ...

    def train(self, mode: bool = True) -> None:
        """Training mode (``True``) or evaluation mode."""
        ...

    def micro_batch(self, batch: RolloutBatch) -> AbstractContextManager:
        """Context around one micro-batch's forward and backward (an MoE policy compares or replays its routes).

        The backward stays inside because activation checkpointing re-runs the forward (and the routers) there.
        """
        ...

    def forward_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)``, each ``[B, T-1]`` on the model's device, differentiable.

        Both are 0 before the batch's first trained position: prompt positions carry no loss, so a backend need
        not form their logits (``RolloutBatch.first_trained_position``).
        """
        ...


class StepPrimitives(Protocol):
    """What a trained model's rank gives an optimizer step: gradients, the step, sums over data-parallel ranks."""

    device: torch.device
    dp_rank: int
    dp_size: int
    model: Any  # the wrapped model (hooks see it)
    optimizer: Any

    def grad_sync(self, enabled: bool) -> None:
        """Reduce gradients over the data-parallel ranks in the next backward (the last micro-batch) or not."""
        ...

    def backward(self, loss: torch.Tensor, units: float, total_units: float) -> None:
        """Backward ``loss`` weighted by its share ``units / total_units`` of the global batch (a sum over ranks)."""
        ...

    def clip_and_step(self, loss_sum: float = 0.0) -> tuple[float, bool]:
        """Clip the global grad norm and step; skipped on every rank if the norm or some ``loss_sum`` is not finite.

        Returns:
            ``(grad norm, skipped)``.

        """
        ...

    def global_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over the data-parallel ranks (float64)."""
        ...

    def global_max(self, value: float) -> float:
        """The largest ``value`` over the data-parallel ranks."""
        ...

    def gather_shards(self, local: torch.Tensor) -> torch.Tensor:
        """Every data shard's ``local`` rows concatenated in shard order (the whole batch), on every rank."""
        ...

    def save(self, path: str) -> None:
        """Collective: save model and optimizer state (and this rank's RNG) into directory ``path``."""
        ...

    def load(self, path: str) -> None:
        """Collective: load what ``save`` wrote."""
        ...


# (micro-batch index, micro-batch, logprobs, entropy) -> (loss, its units, its metric sums): the RL step's loss
LossOf = Callable[[int, RolloutBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float, dict[str, float]]]


class TrainBackend(LogprobModel, StepPrimitives, Protocol):
    """One rank of the trained policy."""

    reference: LogprobModel | None  # the frozen KL reference on this rank, if the trainer keeps one here

    def forward_backward(
        self, batches: list[RolloutBatch], temperature: float, loss_of: LossOf, total_units: float
    ) -> list[dict[str, float]]:
        """Forward and backward every micro-batch, its loss from ``loss_of``, weighted by ``units / total_units``.

        In turn, each inside its ``micro_batch`` context and gradients reduced after the last
        (``torch_parallel.forward_backward_in_turn``); or through a pipeline schedule, where the loss is computed on
        the last stage only.

        Returns:
            ``loss_of``'s stats of each micro-batch, in order, on every rank.

        """
        ...

    def route_counts(self) -> tuple[float, float] | None:
        """MoE: ``(differing, recorded)`` (token, layer) expert sets since the last call (then reset); else None."""
        ...

    def sync_plan(self, dtype: torch.dtype, bucket_bytes: int) -> SyncPlan:
        """Bucket plan of the HF-named tensors a weight sync sends, cast to ``dtype``."""
        ...

    def gather_bucket(self, bucket: Bucket, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Collective over ranks: the bucket packed as one flat tensor on rank 0, None elsewhere.

        ``out`` (a ``bucket.numel`` buffer of ``dtype``) receives it when given: a sender's persistent buffer.
        """
        ...

    def bucket_in_place(self, bucket: Bucket) -> torch.Tensor | None:
        """Rank 0: the bucket as a view of memory the parameters occupy in its layout (nothing to pack), or None.

        Not a collective: it may return a tensor only where ``gather_bucket`` of the bucket is no collective either
        (every rank holds the whole parameters), since the other ranks still call ``gather_bucket``. The view is
        the parameters themselves: valid until the next optimizer step.
        """
        ...

    def publish_in_place(self, dtype: torch.dtype, make_buffer: Callable[[int], torch.Tensor]) -> bool:
        """Rank 0: whether engines may compute on the memory ``bucket_in_place`` views in ``dtype`` from now on.

        If so, the backend writes it no sooner than after two more calls (a shared-memory sync hands engines those
        buckets, copying nothing). ``make_buffer(nbytes)`` makes ``uint8`` memory engines can map, for the backend
        to keep that memory in (a bf16 ``weight_copy`` moves there on the first call). False where the backend keeps
        no such memory.
        """
        ...

    def hf_state(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor] | None]:
        """Collective: ``(HF-named weights, LoRA adapters or None)`` on rank 0, ``(None, None)`` elsewhere."""
        ...


class CriticBackend(StepPrimitives, Protocol):
    """One rank of PPO's value model."""

    def micro_batches(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """The batch's rows cut into micro-batches (``LongTensor`` each), by samples and tokens per forward."""
        ...

    def train(self, mode: bool = True) -> None:
        """Training mode (``True``) or evaluation mode."""
        ...

    def forward_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, T-1]`` values on the model's device, differentiable.

        Position ``t`` values the state that predicts token ``t+1`` (the logprob alignment).
        """
        ...
