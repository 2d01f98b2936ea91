"""VLLMEngineActor: one vLLM server behind the engine-actor interface the Router and WeightBroadcaster use.

It implements ``actors.engine_actor.EngineInterface`` and ``EngineControl`` like the embedded engine's actor, so a
pool of vLLM engines drops into a run unchanged: ``RolloutPoolConfig(engine=VLLMEngineConfig(...))``.

Differences from the embedded engine, by vLLM's design: ``abort`` of one request cancels it and returns
no partial tokens; a weight load pauses the server with ``mode=keep`` (running sequences continue on the
new weights, as the embedded engine's in-place pause) and the checksum is that of the tensors the vLLM
worker loaded (its kernels repack weights, so they cannot be read back in HF layout).
"""

from __future__ import annotations

import asyncio
import time

import torch

from miles_ray.actors.server_engine import ServerEngineActor
from miles_ray.engines.requests import DEFAULT_MODEL_NAME, PauseMode
from miles_ray.engines.vllm import VLLMEngineConfig, VLLMServer
from miles_ray.sync.buckets import SyncPlan


class VLLMEngineActor(ServerEngineActor):
    """One vLLM engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    kind = "vllm"
    accepts_adapters = False  # vLLM's LoRA serving (--enable-lora, load_lora_adapter) is not wired here

    def __init__(self, engine_id: int, config: VLLMEngineConfig, served_model_name: str = DEFAULT_MODEL_NAME):
        super().__init__(engine_id, config, VLLMServer(config, served_model_name))
        self._pending = []

    async def abort(self, request_id: str | None = None) -> None:
        """Cancel one request (all if None); its caller gets an output with no completions."""
        for rid, task in list(self._inflight.items()):
            if request_id is None or rid == request_id:
                task.cancel()

    async def _pause(self, mode: PauseMode) -> None:
        await self._started()  # `in_place` is vLLM's `keep`
        await self.server.post("/pause", params={"mode": "keep" if mode == "in_place" else "abort"})

    async def _resume_server(self) -> None:
        await self.server.post("/resume")

    async def flush_cache(self) -> None:
        """Drop vLLM's prefix cache (it is also dropped after every weight load)."""
        await self._started()
        await self.server.post("/reset_prefix_cache")

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]], alias: bool = False) -> None:
        self._pending.extend(named_tensors)  # views into this sync's bucket buffers, alive until the load ends

    async def _load(
        self, run, plan: SyncPlan, version: int, verify: bool, in_flight: str, known=None, sample=None
    ) -> dict:
        # `known` digests are of this actor's buffers; the server hashes the weights it loads itself
        if plan.adapter is not None:
            raise ValueError(
                "vLLM engines take full weights only: the trainer has backend.lora set (adapter-only sync); "
                "use embedded engines or train without LoRA"
            )
        await self._started()
        start = time.perf_counter()
        self._pending = []
        await asyncio.to_thread(run)
        await self.server.post("/pause", params={"mode": "keep"})
        try:
            self._checksum = await self.server.load_weights(self._pending, verify)
            self._version = version
            await self.server.post("/update_weight_version", {"new_version": str(version)})
        finally:
            self._pending = []
            if not self._user_paused:  # paused by the user before or during the load: it stays paused
                await self._resume_server()
        return {"engine_id": self.engine_id, "seconds": time.perf_counter() - start, "checksum": self._checksum}
