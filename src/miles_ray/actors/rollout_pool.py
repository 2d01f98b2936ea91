"""RolloutPool: a set of rollout engine actors, each on its placement slot, plus their weight-sync endpoints.

``EngineActor`` wraps one embedded engine as an async Ray actor: ``generate`` calls join the engine's
running batch (continuous batching, stepped on a worker thread so ``health`` keeps answering), and with
``RolloutPoolConfig.http`` the same engine also serves SGLang-native and OpenAI HTTP routes. It
receives weight buckets over a broadcast group (disaggregated) or the object store (colocated), pausing
decode in place while a sync loads so no step sees half-updated weights.

Usage::

    pool = RolloutPool.options(name="miles_ray/rollout_pool").remote(RolloutPoolConfig(...), placement)
    engines = ray.get(pool.engines.remote())

The pool owns its engines (Ray fate-sharing): keep the pool handle, or name the pool, for as long as the
engines are used; an unnamed pool whose last handle is dropped takes its engines with it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
import torch
from pydantic import Field, field_validator, model_validator

from miles_ray.config import StrictConfig
from miles_ray.engines.base import GenerateOutput, GenerateRequest
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.placement.groups import Placement
from miles_ray.sync.plan import SyncPlan, unpack
from miles_ray.sync.shm import as_tensor


class RolloutPoolConfig(StrictConfig):
    """How many engines, of which kind, and whether they serve HTTP."""

    num_engines: int = Field(1, ge=1, le=4096, description="Engine actors in the pool (one per engine slot).")
    engine: EmbeddedEngineConfig | VLLMEngineConfig = Field(
        ..., description="Per-engine config, selected by `kind` (embedded, the default when omitted | vllm)."
    )
    http: HttpServerConfig | None = Field(
        None,
        description="Start each embedded engine's HTTP server (SGLang-native + OpenAI API); None: Ray calls only. "
        "vLLM engines always serve their own OpenAI API.",
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _select_engine(cls, value: Any) -> Any:
        # dispatch on `kind` by hand rather than a pydantic tagged union: `kind` may be omitted (embedded, as
        # before vLLM existed) and errors keep the plain path (`engine.num_threads`, not `engine.embedded....`)
        if not isinstance(value, dict):
            return value
        configs = {"embedded": EmbeddedEngineConfig, "vllm": VLLMEngineConfig}
        kind = value.get("kind", "embedded")
        if kind not in configs:
            raise ValueError(f"engine.kind must be one of {sorted(configs)}, got {kind!r}")
        return configs[kind].model_validate(value)

    @model_validator(mode="after")
    def _check_http(self) -> RolloutPoolConfig:
        if self.http is not None and self.engine.kind != "embedded":
            raise ValueError(f"http applies to embedded engines; engine.kind={self.engine.kind!r} serves its own")
        return self

    served_model_name: str = Field("default", description="Model name the OpenAI routes report and accept.")


class WeightReceiver:
    """The engine side of a weight sync, shared by every engine actor.

    A subclass applies each unpacked bucket with ``_apply`` (called on a worker thread) and wraps the whole
    load in ``_load(run, version, verify)``, which runs ``run`` and returns ``{"engine_id", "seconds",
    "checksum"}``.
    """

    engine_id: int
    _sync_group = None

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    async def _load(self, run, version: int, verify: bool) -> dict:
        raise NotImplementedError

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
                self._apply(unpack(bucket, flat))

        return await self._load(run, version, verify)

    async def load_buckets(self, plan: SyncPlan, bucket_refs: list[ray.ObjectRef], version: int, verify: bool = True):
        """Load buckets from the object store (colocated sync; zero-copy reads); then set ``version``.

        Returns:
            As ``receive_broadcast``.

        """
        arrays = await asyncio.gather(*bucket_refs)  # mapped from shared memory, not copied

        def run() -> None:
            for bucket, array in zip(plan.buckets, arrays):
                self._apply(unpack(bucket, as_tensor(array, bucket.dtype)))

        return await self._load(run, version, verify)


class EngineActor(WeightReceiver):
    """One rollout engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    def __init__(self, engine_id: int, config: EmbeddedEngineConfig):
        self.engine_id = engine_id
        self.engine = EmbeddedEngine(config)
        self.loop = EngineLoop(self.engine)
        self._outstanding = 0
        self._sync_group = None
        self._http = None
        self.url: str | None = None

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request``; it joins the engine's running batch (continuous batching).

        Raises:
            ValueError: for an invalid request (the engine stays up).

        """
        self._outstanding += 1
        try:
            out = await self.loop.generate(request)
        finally:
            self._outstanding -= 1
        out.engine_id = self.engine_id
        return out

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request (all if None); its caller gets what was generated so far."""
        self.loop.abort(request_id)

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation (``abort`` | ``in_place``); see ``EmbeddedEngine.pause``."""
        await self.loop.pause(mode)

    async def resume(self) -> None:
        """Continue after ``pause``."""
        self.loop.resume()

    async def flush_cache(self) -> None:
        """Nothing to drop: the embedded engine shares a prefix only within one request (no cross-request cache)."""

    async def start_http(self, config: HttpServerConfig, model_name: str = "default") -> str:
        """Serve this engine over HTTP (same running batch as Ray calls). Returns the base URL."""
        from miles_ray.engines.http_server import start_server

        if self._http is None:
            self._http, self.url = await start_server(self.loop, model_name, config)
        return self.url

    async def health(self) -> dict:
        """Liveness plus load: queue depth and the loaded weight version."""
        return {
            "engine_id": self.engine_id,
            "outstanding": self._outstanding,
            "version": self.engine.weight_version(),
            "url": self.url,
            **self.engine.stats(),
        }

    # --- weights --------------------------------------------------------------------------------
    async def weight_version(self) -> int:
        """Version of the loaded weights."""
        return self.engine.weight_version()

    async def weights_checksum(self) -> str:
        """Checksum of the loaded weights."""
        return await asyncio.to_thread(self.engine.weights_checksum)

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    async def _load(self, run, version: int, verify: bool) -> dict:
        # no decode step may see half-updated weights: pause in place around the load (running
        # sequences continue on the new weights afterwards)
        was_paused = self.engine.paused
        await self.loop.pause("in_place")
        start = time.perf_counter()
        try:
            await asyncio.to_thread(run)
            self.engine.set_weight_version(version)
        finally:
            if not was_paused:
                self.loop.resume()
        seconds = time.perf_counter() - start
        # hashing here, right after loading, runs in parallel with the trainer's hash of what it sent
        checksum = await asyncio.to_thread(self.engine.weights_checksum) if verify else None
        return {"engine_id": self.engine_id, "seconds": seconds, "checksum": checksum}


@ray.remote(num_cpus=0)
class RolloutPool:
    """Creates and owns the engine actors of a run (one per ``placement.plan.engine_slots`` entry)."""

    def __init__(self, config: RolloutPoolConfig, placement: Placement):
        self.config = config
        if config.engine.kind == "vllm":
            from miles_ray.actors.vllm_engine import VLLMEngineActor

            cls, args = VLLMEngineActor, lambda i: (i, config.engine, config.served_model_name)
        else:
            cls, args = EngineActor, lambda i: (i, config.engine)
        self._engines = placement.spawn(
            cls, "engine", "RolloutPoolConfig.num_engines", config.num_engines, args, max_concurrency=1000
        )
        # fail at setup, not on the first request: wait until every engine has loaded its model
        health = ray.get([e.health.remote() for e in self._engines])
        self._urls = None
        if config.engine.kind == "vllm":
            self._urls = [h["url"] for h in health]
        elif config.http is not None:
            self._urls = ray.get([e.start_http.remote(config.http, config.served_model_name) for e in self._engines])

    def engines(self) -> list:
        """Handles of the engine actors, in engine-id order."""
        return list(self._engines)

    def urls(self) -> list[str]:
        """Base URLs of the engines' HTTP servers, in engine-id order.

        Raises:
            RuntimeError: if the pool's engines serve no HTTP (embedded engines without ``http``).

        """
        if self._urls is None:
            raise RuntimeError("RolloutPoolConfig.http is None: the engines serve no HTTP")
        return list(self._urls)

    def num_engines(self) -> int:
        """How many engines the pool runs."""
        return len(self._engines)
