"""ReplayBuffer: holds sample groups by reference (payloads stay in the Ray object store) and hands out batches.

Each entry is a ``GroupRef`` (``miles_ray.types``): an ``ObjectRef`` to a ``list[Sample]`` (the n responses to one
prompt, kept together for GRPO) plus the metadata the buffer needs to decide without fetching the payload.
Consumption is FIFO; groups older than ``max_staleness`` weight versions are dropped (and counted) when
a batch is taken.

Usage::

    buffer = ReplayBuffer.options(name="miles_ray/replay_buffer").remote(ReplayBufferConfig())
    ray.get(buffer.add.remote([GroupRef(ray.put(samples), len(samples), version, group_id)]))
    refs = ray.get(buffer.get_batch.remote(num_groups=8, current_version=version))
"""

from __future__ import annotations

import asyncio
import collections
import time

import ray
from pydantic import Field

from miles_ray.config import StrictConfig
from miles_ray.deprecation import moved
from miles_ray.types import GroupRef as _GroupRef

# GroupRef lived here before it moved to miles_ray.types (rollout functions build them without the buffer); the
# old name still resolves, with a DeprecationWarning, so it is imported above under another one
__getattr__ = moved(__name__, {"GroupRef": "miles_ray.types:GroupRef"})


class ReplayBufferConfig(StrictConfig):
    """Capacity and staleness policy."""

    capacity_groups: int = Field(100_000, ge=1, description="Groups held at most; adding past it raises.")
    max_staleness: int | None = Field(
        None, ge=0, description="Drop groups generated more than this many weight versions ago; None keeps all."
    )


@ray.remote(num_cpus=0)
class ReplayBuffer:
    """FIFO store of sample groups by reference (an async actor: ``get_batch`` may wait while producers add)."""

    def __init__(self, config: ReplayBufferConfig):
        self.config = config
        self._groups: collections.deque[_GroupRef] = collections.deque()
        self._num_dropped_stale = 0
        self._num_added = 0
        self._num_taken = 0
        self._staleness_hist: collections.Counter[int] = collections.Counter()  # of the groups handed out
        self._last_staleness = {"mean": 0.0, "max": 0}
        self._changed = asyncio.Condition()
        self._dropped_reported = 0

    async def add(self, groups: list[_GroupRef]) -> int:
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
        self._gauges()
        async with self._changed:
            self._changed.notify_all()
        return len(self._groups)

    def _drop_stale(self, current_version: int | None) -> None:
        if current_version is None or self.config.max_staleness is None:
            return
        floor = current_version - self.config.max_staleness
        fresh = [g for g in self._groups if g.weight_version >= floor]
        self._num_dropped_stale += len(self._groups) - len(fresh)
        self._groups = collections.deque(fresh)

    async def get_batch(
        self, num_groups: int, current_version: int | None = None, timeout_s: float | None = None
    ) -> list[_GroupRef] | None:
        """Pop the oldest ``num_groups`` fresh groups, or None (nothing popped) if fewer are held.

        Args:
            num_groups: groups to return.
            current_version: the trainer's weight version, for the staleness bound and staleness stats.
            timeout_s: wait up to this long for enough fresh groups (fully async training: an AsyncRollout
                keeps adding); None returns at once.

        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._drop_stale(current_version)
        while len(self._groups) < num_groups:
            left = None if deadline is None else deadline - time.monotonic()
            if left is None or left <= 0:
                return None
            try:
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return None
            self._drop_stale(current_version)
        batch = [self._groups.popleft() for _ in range(num_groups)]
        self._num_taken += len(batch)
        if current_version is not None:
            ages = [current_version - g.weight_version for g in batch]
            self._staleness_hist.update(ages)
            self._last_staleness = {"mean": sum(ages) / len(ages), "max": max(ages)}
        self._gauges()
        return batch

    def _gauges(self) -> None:
        from miles_ray import metrics as mx

        mx.gauge("buffer_groups", "Groups held by the replay buffer").set(len(self._groups))
        mx.gauge("buffer_staleness_mean", "Mean versions behind, last batch").set(self._last_staleness["mean"])
        mx.gauge("buffer_staleness_max", "Most versions behind, last batch").set(self._last_staleness["max"])
        dropped = self._num_dropped_stale - self._dropped_reported
        if dropped:
            mx.counter("buffer_dropped_stale_total", "Groups dropped as too stale").inc(dropped)
            self._dropped_reported = self._num_dropped_stale

    async def size(self) -> int:
        """Groups held."""
        return len(self._groups)

    async def stats(self) -> dict:
        """Counters: held groups and samples, added, taken, dropped as stale; staleness of the groups taken.

        ``staleness_hist`` maps versions behind the trainer (when taken) to group counts; ``staleness_mean`` and
        ``staleness_max`` are those of the last batch.
        """
        return {
            "groups": len(self._groups),
            "samples": sum(g.num_samples for g in self._groups),
            "added": self._num_added,
            "taken": self._num_taken,
            "dropped_stale": self._num_dropped_stale,
            "staleness_mean": self._last_staleness["mean"],
            "staleness_max": self._last_staleness["max"],
            "staleness_hist": dict(self._staleness_hist),
        }

    async def state(self) -> dict:
        """Everything held, payloads included (for a run checkpoint): ``load_state`` restores it."""
        payloads = await asyncio.gather(*(g.ref for g in self._groups))
        meta = [(g.num_samples, g.weight_version, g.group_id) for g in self._groups]
        counters = {"added": self._num_added, "taken": self._num_taken, "dropped_stale": self._num_dropped_stale}
        return {"groups": list(zip(meta, payloads)), "counters": counters, "staleness_hist": dict(self._staleness_hist)}

    async def load_state(self, state: dict) -> int:
        """Replace the contents with a ``state()`` result; returns the number of groups held."""
        self._groups = collections.deque(_GroupRef(ray.put(p), *m) for m, p in state["groups"])
        c = state["counters"]
        self._num_added = c["added"]
        self._num_taken = c["taken"]
        self._num_dropped_stale = c["dropped_stale"]
        self._staleness_hist = collections.Counter({int(k): v for k, v in state["staleness_hist"].items()})
        return len(self._groups)
