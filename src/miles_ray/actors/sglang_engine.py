"""SGLangEngineActor: one SGLang server behind the engine-actor interface the Router and WeightBroadcaster use.

Same methods as ``EngineActor`` (``generate``, ``flush_cache``, ``abort``, ``pause``, ``resume``, ``health``,
``weight_version``, ``weights_checksum``, ``join_sync_group``, ``receive_broadcast``, ``load_buckets``), so a pool
of SGLang engines drops into a run unchanged: ``RolloutPoolConfig(engine=SGLangEngineConfig(...))``.

Weights, disaggregated: the server's TP ranks join the trainer's broadcast group themselves
(``/init_weights_update_group``) and receive each bucket's bytes straight from trainer rank 0
(``/update_weights_from_distributed``, ``flattened_bucket``); nothing passes through this actor. Colocated: the
buckets come from the object store and go to the server as shared-memory tensor handles
(``/update_weights_from_tensor``). A load pauses the server ``in_place`` (running requests continue on the new
weights, as the embedded engine's in-place pause). The checksum is a ``probe`` one
(``miles_ray.sync.checksum.probe_checksum``): SGLang fuses q/k/v and gate/up, so it can return each HF-named
tensor's first row but not its bytes in HF layout.
"""

from __future__ import annotations

import asyncio
import base64
import time

from miles_ray.actors.server_engine import ServerEngineActor
from miles_ray.engines.sglang import SGLangEngineConfig, SGLangError, SGLangServer
from miles_ray.sync.checksum import probe_checksum
from miles_ray.sync.gloo import group_name
from miles_ray.sync.plan import SyncPlan, unpack
from miles_ray.sync.shm import as_tensor


class SGLangEngineActor(ServerEngineActor):
    """One SGLang engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    kind = "sglang"
    accepts_adapters = False  # adapter-only syncs (SyncPlan.adapter) are not mapped onto load_lora_adapter yet

    def __init__(self, engine_id: int, config: SGLangEngineConfig, served_model_name: str = "policy"):
        super().__init__(engine_id, config, SGLangServer(config, served_model_name))
        self._group_name: str | None = None  # of the broadcast group the server's ranks are in

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request on the server (all if None); its caller gets what SGLang returns for it."""
        await self._started()
        body = {"abort_all": True} if request_id is None else {"rid": request_id}
        await self.server.post("/abort_request", body)

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation: ``abort`` in-flight requests or keep them ``in_place``."""
        if mode not in ("abort", "in_place"):
            raise ValueError(f"pause mode must be 'abort' or 'in_place', got {mode!r}")
        await self._started()
        await self.server.post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Continue after ``pause``."""
        await self.server.post("/continue_generation", {})

    async def flush_cache(self) -> None:
        """Drop SGLang's radix (prefix) cache; it is also flushed after every weight load."""
        await self._started()
        await self.server.request("POST", "/flush_cache")

    async def release_memory(self) -> None:
        """Colocated on GPUs: free weights and KV cache while the trainer runs (``enable_memory_saver``)."""
        await self._started()
        await self.server.call("/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        """Take the memory back after ``release_memory`` (load weights afterwards)."""
        await self.server.call("/resume_memory_occupation", {})

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve a peft adapter directory as ``name`` (server started with ``sglang_args={'enable_lora': True}``)."""
        await self._started()
        await self.server.call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``."""
        await self.server.call("/unload_lora_adapter", {"lora_name": name})

    async def server_weight_version(self) -> str:
        """The weight version the SGLang server itself reports (``/get_model_info``)."""
        out = await self.server.request("GET", "/get_model_info")
        return str(out["weight_version"])

    async def checksum_kind(self) -> str:
        """``probe``: first values of each tensor's first row (see the module docstring)."""
        return "probe"

    async def sync_ranks(self) -> int:
        """The server's TP ranks each join the broadcast group."""
        return self.config.tp_size

    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Have the server's TP ranks join the broadcast group as ranks ``rank .. rank + tp_size - 1``."""
        await self._started()
        body = {"master_address": host, "master_port": port, "rank_offset": rank, "world_size": world_size,
                "group_name": group_name(port), "backend": backend}  # fmt: skip
        if self._group_name is not None:  # a re-formed group (respawned engine or trainer): leave the old one first
            await self.server.call("/destroy_weights_update_group", {"group_name": self._group_name})
            self._group_name = None
        await self.server.call("/init_weights_update_group", body)
        self._group_name = group_name(port)

    async def receive_broadcast(self, plan: SyncPlan, version: int, verify: bool = True, in_flight: str = "continue"):
        """The server receives every bucket of ``plan`` from group rank 0 and loads it; then ``version`` is set.

        Returns:
            ``{"engine_id", "seconds", "checksum"}``; the probe checksum only if ``verify``.

        """
        if self._group_name is None:
            raise RuntimeError("receive_broadcast before join_sync_group")

        async def load() -> None:
            for i, bucket in enumerate(plan.buckets):
                last = i == len(plan.buckets) - 1
                body = {
                    "names": [m.name for m in bucket.tensors],
                    "dtypes": [str(bucket.dtype).removeprefix("torch.")] * len(bucket.tensors),
                    "shapes": [list(m.shape) for m in bucket.tensors],
                    "group_name": self._group_name, "load_format": "flattened_bucket", "flush_cache": last,
                }  # fmt: skip
                await self.server.call("/update_weights_from_distributed", body)

        return await self._update(load, plan, version, verify, in_flight)

    async def load_buckets(self, plan: SyncPlan, bucket_refs: list, version: int, verify: bool = True,
                           in_flight: str = "continue") -> dict:  # fmt: skip
        """Load buckets from the object store through ``/update_weights_from_tensor`` (colocated sync).

        Returns:
            As ``receive_broadcast``.

        """
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing

        # by name in /dev/shm: the default (fd passing) authenticates with a key only related processes share
        torch.multiprocessing.set_sharing_strategy("file_system")

        arrays = await asyncio.gather(*bucket_refs)

        async def load() -> None:
            for i, (bucket, array) in enumerate(zip(plan.buckets, arrays)):
                # tensors travel as shared-memory handles (SGLang's MultiprocessingSerializer format)
                named = [(n, t.clone()) for n, t in unpack(bucket, as_tensor(array, bucket.dtype))]
                blob = base64.b64encode(ForkingPickler.dumps(named)).decode()
                body = {"serialized_named_tensors": [blob] * self.config.tp_size,
                        "flush_cache": i == len(plan.buckets) - 1}  # fmt: skip
                await self.server.call("/update_weights_from_tensor", body)

        return await self._update(load, plan, version, verify, in_flight)

    async def _update(self, load, plan: SyncPlan, version: int, verify: bool, in_flight: str) -> dict:
        if in_flight != "continue":  # SGLang's abort/retract pauses are not mapped onto finish/abort_resume yet
            raise ValueError(f"SGLang engines support in_flight='continue' only, got {in_flight!r}")
        if plan.adapter is not None:
            raise ValueError("SGLang engines take full weights only: the trainer has backend.lora set")
        await self._started()
        start = time.perf_counter()
        await self.server.post("/pause_generation", {"mode": "in_place"})
        try:
            session = await self._optional("/begin_weight_update")
            try:
                await load()
            finally:  # close the session even after a failed load, so the server can take the next one
                if session:
                    await self.server.call("/end_weight_update", {})
            await self.server.call("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
            self._version = version
        finally:
            await self.server.post("/continue_generation", {})
        self._checksum = None
        if verify:
            self._checksum = probe_checksum(await self.server.weight_rows(plan.names))
        return {"engine_id": self.engine_id, "seconds": time.perf_counter() - start, "checksum": self._checksum}

    async def _optional(self, route: str) -> bool:
        """Call a route newer SGLang releases require and older ones lack; False where the server has none."""
        try:
            await self.server.call(route, {})
        except SGLangError as exc:
            if " answered 404" in str(exc):
                return False
            raise
        return True


__all__ = ["SGLangEngineActor"]
