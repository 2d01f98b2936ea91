"""VLLMEngineActor: one vLLM server behind the engine-actor interface the Router and WeightBroadcaster use.

Same methods as ``EngineActor`` (``generate``, ``flush_cache``, ``abort``, ``pause``, ``resume``, ``health``,
``weight_version``, ``weights_checksum``, ``join_sync_group``, ``receive_broadcast``, ``load_buckets``), so a pool
of vLLM engines drops into a run unchanged: ``RolloutPoolConfig(engine=VLLMEngineConfig(...))``.

Differences from the embedded engine, by vLLM's design: ``abort`` of one request cancels it and returns
no partial tokens; a weight load pauses the server with ``mode=keep`` (running sequences continue on the
new weights, as the embedded engine's in-place pause) and the checksum is that of the tensors the vLLM
worker loaded (its kernels repack weights, so they cannot be read back in HF layout).
"""

from __future__ import annotations

import asyncio
import time

import torch

from miles_ray.actors.rollout_pool import WeightReceiver
from miles_ray.engines.base import GenerateOutput, GenerateRequest
from miles_ray.engines.vllm import VLLMEngineConfig, VLLMServer
from miles_ray.sync.plan import SyncPlan


class VLLMEngineActor(WeightReceiver):
    """One vLLM engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    def __init__(self, engine_id: int, config: VLLMEngineConfig, served_model_name: str = "policy"):
        self.engine_id, self.config = engine_id, config
        self.server = VLLMServer(config, served_model_name)
        self.url = self.server.url
        self._version, self._checksum = 0, None
        self._outstanding, self._pending = 0, []
        self._inflight: dict[str, asyncio.Task] = {}
        self._ready = None

    async def _started(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self.server.wait_healthy())
        await self._ready

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request`` on the server (vLLM batches concurrent requests itself).

        Raises:
            ValueError: for a request vLLM rejects (e.g. too long for ``max_model_len``).

        """
        await self._started()
        first, self._outstanding = self._version, self._outstanding + 1
        task = asyncio.ensure_future(self.server.generate(request))
        self._inflight[request.request_id] = task
        try:
            completions = await task
        except asyncio.CancelledError:
            completions = []  # aborted: vLLM drops the request when the connection closes
        finally:
            self._outstanding -= 1
            self._inflight.pop(request.request_id, None)
        return GenerateOutput(request.request_id, completions, self._version, self.engine_id, first)

    async def abort(self, request_id: str | None = None) -> None:
        """Cancel one request (all if None); its caller gets an output with no completions."""
        for rid, task in list(self._inflight.items()):
            if request_id is None or rid == request_id:
                task.cancel()

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation: ``abort`` in-flight requests or keep them ``in_place`` (vLLM ``keep``)."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")
        await self._started()
        await self.server.post("/pause", params={"mode": "keep" if mode == "in_place" else "abort"})

    async def resume(self) -> None:
        """Continue after ``pause``."""
        await self.server.post("/resume")

    async def flush_cache(self) -> None:
        """Drop vLLM's prefix cache (it is also dropped after every weight load)."""
        await self._started()
        await self.server.post("/reset_prefix_cache")

    async def health(self) -> dict:
        """Liveness (waits for the server on the first call) plus load and the loaded weight version."""
        await self._started()
        self.server.check_alive()
        return {"engine_id": self.engine_id, "outstanding": self._outstanding, "version": self._version,
                "url": self.url, "kind": "vllm"}  # fmt: skip

    async def shutdown(self) -> None:
        """Stop the server process."""
        await self.server.aclose()

    def __del__(self):
        self.server.close()

    # --- weights --------------------------------------------------------------------------------
    async def weight_version(self) -> int:
        """Version of the loaded weights."""
        return self._version

    async def weights_checksum(self) -> str | None:
        """Digest of the weights the vLLM worker last loaded (None before the first sync)."""
        return self._checksum

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._pending.extend(named_tensors)  # views into this sync's bucket buffers, alive until the load ends

    accepts_adapters = False  # vLLM's LoRA serving (--enable-lora, load_lora_adapter) is not wired here

    async def _load(self, run, plan: SyncPlan, version: int, verify: bool, in_flight: str) -> dict:
        if in_flight != "continue":  # vLLM's pause modes map to the others, untested here: refuse rather than guess
            raise ValueError(f"vLLM engines support in_flight='continue' only, got {in_flight!r}")
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
            await self.server.post("/resume")
        return {"engine_id": self.engine_id, "seconds": time.perf_counter() - start, "checksum": self._checksum}
