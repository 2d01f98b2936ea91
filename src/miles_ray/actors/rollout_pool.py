"""RolloutPool: a set of rollout engine actors, each on its placement slot, plus their weight-sync endpoints.

``EngineActor`` wraps one ``RolloutEngine`` (the embedded engine by default) as an async Ray actor:
concurrent ``generate`` calls are queued and decoded together in one batch (requests that arrive while
a batch runs form the next one), on a worker thread so ``health`` keeps answering. It also receives
weight buckets over a broadcast group (disaggregated) or the object store (colocated).

Usage::

    pool = RolloutPool.options(name="miles_ray/rollout_pool").remote(RolloutPoolConfig(...), placement)
    engines = ray.get(pool.engines.remote())

The pool owns its engines (Ray fate-sharing): keep the pool handle, or name the pool, for as long as the
engines are used; an unnamed pool whose last handle is dropped takes its engines with it.
"""

from __future__ import annotations

import asyncio
import time

import ray
import torch
from pydantic import Field

from miles_ray.config import StrictConfig
from miles_ray.engines.base import GenerateOutput, GenerateRequest
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.placement.groups import Placement
from miles_ray.sync.plan import SyncPlan, unpack
from miles_ray.sync.shm import as_tensor


class RolloutPoolConfig(StrictConfig):
    """How many engines, of which kind."""

    num_engines: int = Field(1, ge=1, le=4096, description="Engine actors in the pool (one per engine slot).")
    engine: EmbeddedEngineConfig = Field(..., description="Per-engine config (discriminated by `kind`).")
    batch_wait_s: float = Field(
        0.005, ge=0.0, le=1.0, description="How long an idle engine waits to gather concurrent requests."
    )


class EngineActor:
    """One rollout engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    def __init__(self, engine_id: int, config: EmbeddedEngineConfig, batch_wait_s: float = 0.005):
        self.engine_id = engine_id
        self.engine = EmbeddedEngine(config)
        self._batch_wait_s = batch_wait_s
        self._queue: asyncio.Queue | None = None
        self._outstanding = 0
        self._sync_group = None

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request``; batched with the requests that arrive alongside it.

        Raises:
            ValueError: for an invalid request (the engine stays up).

        """
        self.engine.validate(request)  # reject bad input here, before it joins a batch
        if self._queue is None:
            self._queue = asyncio.Queue()
            asyncio.get_running_loop().create_task(self._batch_loop())
        fut = asyncio.get_running_loop().create_future()
        self._outstanding += 1
        await self._queue.put((request, fut))
        try:
            out = await fut
        finally:
            self._outstanding -= 1
        out.engine_id = self.engine_id
        return out

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        while True:
            items = [await self._queue.get()]
            await asyncio.sleep(self._batch_wait_s)
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            try:
                outs = await asyncio.to_thread(self.engine.generate, [r for r, _ in items])
                for (_, fut), out in zip(items, outs):
                    fut.set_result(out)
            except Exception as exc:  # a failing batch fails its requests, never the engine
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(exc)

    async def health(self) -> dict:
        """Liveness plus load: queue depth and the loaded weight version."""
        return {"engine_id": self.engine_id, "outstanding": self._outstanding, "version": self.engine.weight_version()}

    # --- weights --------------------------------------------------------------------------------
    async def weight_version(self) -> int:
        """Version of the loaded weights."""
        return self.engine.weight_version()

    async def weights_checksum(self) -> str:
        """Checksum of the loaded weights."""
        return await asyncio.to_thread(self.engine.weights_checksum)

    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group used for disaggregated weight sync."""
        from miles_ray.sync.gloo import BroadcastGroup

        self._sync_group = await asyncio.to_thread(BroadcastGroup.create, host, port, rank, world_size, backend)

    async def receive_broadcast(self, plan: SyncPlan, version: int, verify: bool = True) -> dict:
        """Receive every bucket of ``plan`` from group rank 0 and load it; then set ``version``.

        Returns:
            ``{"engine_id", "seconds", "checksum"}``; the checksum (of the weights now held) only if ``verify``.

        """
        if self._sync_group is None:
            raise RuntimeError("receive_broadcast before join_sync_group")

        def run() -> None:
            for bucket in plan.buckets:
                flat = torch.empty(bucket.numel, dtype=bucket.dtype)
                self._sync_group.broadcast(flat)
                self.engine.update_weights(unpack(bucket, flat))

        return await self._load(run, version, verify)

    async def load_buckets(self, plan: SyncPlan, bucket_refs: list[ray.ObjectRef], version: int, verify: bool = True):
        """Load buckets from the object store (colocated sync; zero-copy reads); then set ``version``.

        Returns:
            As ``receive_broadcast``.

        """
        arrays = await asyncio.gather(*bucket_refs)  # mapped from shared memory, not copied

        def run() -> None:
            for bucket, array in zip(plan.buckets, arrays):
                self.engine.update_weights(unpack(bucket, as_tensor(array, bucket.dtype)))

        return await self._load(run, version, verify)

    async def _load(self, run, version: int, verify: bool) -> dict:
        start = time.perf_counter()
        await asyncio.to_thread(run)
        seconds = time.perf_counter() - start
        self.engine.set_weight_version(version)
        # hashing here, right after loading, runs in parallel with the trainer's hash of what it sent
        checksum = await asyncio.to_thread(self.engine.weights_checksum) if verify else None
        return {"engine_id": self.engine_id, "seconds": seconds, "checksum": checksum}


@ray.remote(num_cpus=0)
class RolloutPool:
    """Creates and owns the engine actors of a run (one per ``placement.plan.engine_slots`` entry)."""

    def __init__(self, config: RolloutPoolConfig, placement: Placement):
        self.config = config
        self._engines = placement.spawn(
            EngineActor,
            "engine",
            "RolloutPoolConfig.num_engines",
            config.num_engines,
            lambda i: (i, config.engine, config.batch_wait_s),
            max_concurrency=1000,
        )
        # fail at setup, not on the first request: wait until every engine has loaded its model
        ray.get([e.health.remote() for e in self._engines])

    def engines(self) -> list:
        """Handles of the engine actors, in engine-id order."""
        return list(self._engines)

    def num_engines(self) -> int:
        """How many engines the pool runs."""
        return len(self._engines)
