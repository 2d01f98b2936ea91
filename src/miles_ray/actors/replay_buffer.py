"""ReplayBuffer: holds sample groups by reference (payloads stay in the Ray object store) and hands out batches.

Each entry is a ``GroupRef``: an ``ObjectRef`` to a ``list[Sample]`` (the n responses to one prompt,
kept together for GRPO) plus the metadata the buffer needs to decide without fetching the payload.
Consumption is FIFO; groups older than ``max_staleness`` weight versions are dropped (and counted) when
a batch is taken.

Usage::

    buffer = ReplayBuffer.options(name="miles_ray/replay_buffer").remote(ReplayBufferConfig())
    ray.get(buffer.add.remote([GroupRef(ray.put(samples), len(samples), version, group_id)]))
    refs = ray.get(buffer.get_batch.remote(num_groups=8, current_version=version))
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import ray
from pydantic import Field

from miles_ray.config import StrictConfig


class ReplayBufferConfig(StrictConfig):
    """Capacity and staleness policy."""

    capacity_groups: int = Field(100_000, ge=1, description="Groups held at most; adding past it raises.")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop groups generated more than this many weight versions ago; None keeps all."
    )


@dataclass(frozen=True)
class GroupRef:
    """A reference to one stored group and what the buffer knows of it without fetching it."""

    ref: ray.ObjectRef
    num_samples: int
    weight_version: int
    group_id: int


@ray.remote(num_cpus=0)
class ReplayBuffer:
    """FIFO store of sample groups by reference."""

    def __init__(self, config: ReplayBufferConfig):
        self.config = config
        self._groups: collections.deque[GroupRef] = collections.deque()
        self._num_dropped_stale = 0
        self._num_added = 0

    def add(self, groups: list[GroupRef]) -> int:
        """Append groups; returns the number of groups held.

        Raises:
            ValueError: if the groups would exceed ``capacity_groups`` (nothing is added then).

        """
        if len(self._groups) + len(groups) > self.config.capacity_groups:
            raise ValueError(
                f"ReplayBuffer capacity_groups={self.config.capacity_groups} exceeded: holding {len(self._groups)}, "
                f"adding {len(groups)}"
            )
        self._groups.extend(groups)
        self._num_added += len(groups)
        return len(self._groups)

    def get_batch(self, num_groups: int, current_version: int | None = None) -> list[GroupRef] | None:
        """Pop the oldest ``num_groups`` fresh groups, or None (nothing popped) if fewer are held.

        Args:
            num_groups: groups to return.
            current_version: the trainer's weight version, for the staleness bound.

        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if current_version is not None and self.config.max_staleness is not None:
            floor = current_version - self.config.max_staleness
            fresh = [g for g in self._groups if g.weight_version >= floor]
            self._num_dropped_stale += len(self._groups) - len(fresh)
            self._groups = collections.deque(fresh)
        if len(self._groups) < num_groups:
            return None
        return [self._groups.popleft() for _ in range(num_groups)]

    def size(self) -> int:
        """Groups held."""
        return len(self._groups)

    def stats(self) -> dict:
        """Counters: held groups and samples, added, dropped as stale."""
        return {
            "groups": len(self._groups),
            "samples": sum(g.num_samples for g in self._groups),
            "added": self._num_added,
            "dropped_stale": self._num_dropped_stale,
        }
