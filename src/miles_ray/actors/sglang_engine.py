"""SGLangEngineActor: one SGLang server behind the engine-actor interface the Router and WeightBroadcaster use.

It implements ``actors.engine_actor.EngineInterface`` and ``EngineControl`` like the embedded engine's actor, so a
pool of SGLang engines drops into a run unchanged: ``RolloutPoolConfig(engine=SGLangEngineConfig(...))``.

Weights, disaggregated: the server's TP ranks join the trainer's broadcast group themselves
(``/init_weights_update_group``) and receive each bucket's bytes straight from trainer rank 0
(``/update_weights_from_distributed``, ``flattened_bucket``); nothing passes through this actor. Colocated: the
buckets come from the object store and go to the server as shared-memory tensor handles
(``/update_weights_from_tensor``). A load pauses the server ``in_place`` (running requests continue on the new
weights, as the embedded engine's in-place pause). The checksum is a ``probe`` one
(``miles_ray.sync.checksum.probe_checksum``): SGLang fuses q/k/v and gate/up, so it can return each HF-named
tensor's first row but not its bytes in HF layout.

With ``SGLangEngineConfig.lora`` the engine takes a LoRA trainer's adapter-only syncs instead: this actor takes
the adapter's buckets (it is the broadcast group's peer itself, or reads the object store) and loads them as a
new SGLang adapter per version (``/load_lora_adapter_from_tensors``, every tensor's SHA-256 checked by each TP
rank); new requests name it, running ones finish on the adapter they started with, which is then unloaded.
"""

from __future__ import annotations

import asyncio
import base64
import time

import torch
import torch.multiprocessing

from miles_ray.actors.server_engine import ServerEngineActor
from miles_ray.engines.requests import DEFAULT_MODEL_NAME, GenerateOutput, GenerateRequest, PauseMode
from miles_ray.engines.sglang import SGLangEngineConfig, SGLangError, SGLangServer
from miles_ray.sync.broadcast import group_name
from miles_ray.sync.buckets import AdapterSpec, SyncPlan, unpack
from miles_ray.sync.checksum import named_tensors_checksum, probe_checksum
from miles_ray.sync.digest import tensor_sha256
from miles_ray.sync.shm import shared_empty


class SGLangEngineActor(ServerEngineActor):
    """One SGLang engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    kind = "sglang"

    def __init__(self, engine_id: int, config: SGLangEngineConfig, served_model_name: str = DEFAULT_MODEL_NAME):
        super().__init__(engine_id, config, SGLangServer(config, served_model_name))
        # tensors go to the server by name in /dev/shm: the default strategy (fd passing) authenticates with a
        # key only related processes share
        torch.multiprocessing.set_sharing_strategy("file_system")
        # with config.lora it takes adapter-only syncs, and only those
        self.accepts_adapters = config.lora is not None
        self.accepts_full_weights = config.lora is None
        self._group_name: str | None = None  # of the broadcast group the server's ranks are in
        self._adapter: str | None = None  # the LoRA adapter new requests use (None: the base weights)
        self._unloading: asyncio.Task | None = None  # the previous adapter's unload, once its requests finish
        self._paused = False  # the server holds new requests (a pause, a weight load)
        self._held: set[str] = set()  # requests sent while it was paused, not yet released

    def _request_options(self) -> dict:
        return {"adapter": self._adapter}

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """As ``ServerEngineActor.generate``; a request sent to the paused server is held there until it continues."""
        if self._paused and request.request_id:
            self._held.add(request.request_id)
        try:
            return await super().generate(request)
        finally:
            self._held.discard(request.request_id)

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request on the server (all if None); its caller gets what SGLang returns for it.

        A request the paused server holds gets no output (``completions == []``, as vLLM answers it): SGLang marks
        its abort sent but has not scheduled it yet, so the abort is lost and the request would run to its end once
        the server continues. This actor drops it instead (closing its connection; SGLang aborts it when it sees the
        client gone) and does not send SGLang the abort it would lose.
        """
        await self._started()
        held = list(self._held) if request_id is None else [request_id] if request_id in self._held else []
        for rid in held:
            if (task := self._inflight.get(rid)) is not None:
                task.cancel()
        if request_id is None or not held:
            await self.server.post("/abort_request", {"abort_all": True} if request_id is None else {"rid": request_id})

    async def _pause(self, mode: PauseMode) -> None:
        await self._started()
        await self._pause_server(mode)

    async def _pause_server(self, mode: PauseMode) -> None:
        self._paused = True  # before the route: a request sent meanwhile may be held already
        await self.server.post("/pause_generation", {"mode": mode})

    async def _resume_server(self) -> None:
        await self.server.post("/continue_generation", {})
        self._paused = False
        self._held.clear()  # released: SGLang schedules them, and aborts reach them again

    async def flush_cache(self) -> None:
        """Drop SGLang's radix (prefix) cache; it is also flushed after every weight load."""
        await self._started()
        await self.server.request("POST", "/flush_cache")

    async def release_memory(self) -> bool:
        """Free the server's weights and KV cache while a colocated trainer trains (``enable_memory_saver``).

        Raises:
            RuntimeError: with requests in flight (SGLang releases memory only when idle; it would crash).

        """
        await self._started()
        if self._outstanding:
            raise RuntimeError(f"release_memory with {self._outstanding} requests in flight: finish or abort them")
        await self.server.call("/release_memory_occupation", {})
        return self.config.enable_memory_saver  # without it SGLang keeps the memory (and says so in its log)

    async def resume_memory(self, tags: str | list[str] | None = None) -> bool:
        """Take the memory back: ``weights`` (then sync them), ``kv_cache``; None: both."""
        tags = [tags] if isinstance(tags, str) else tags
        await self.server.call("/resume_memory_occupation", {"tags": tags} if tags else {})
        return self.config.enable_memory_saver

    async def server_weight_version(self) -> str:
        """The weight version the SGLang server itself reports (``/get_model_info``)."""
        out = await self.server.request("GET", "/get_model_info")
        return str(out["weight_version"])

    async def checksum_kind(self) -> str:
        """``probe``: first values of each tensor's first row (see the module docstring); adapter syncs: ``full``."""
        return "probe" if self.config.lora is None else "full"

    async def sync_ranks(self) -> int:
        """The server's TP ranks each join the broadcast group (adapter syncs: this actor does, as one rank)."""
        return self.config.tp_size if self.config.lora is None else 1

    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, collective: str) -> None:
        """Have the server's TP ranks join the broadcast group as ranks ``rank .. rank + tp_size - 1``.

        With ``config.lora`` this actor joins instead: it relays each adapter (a few MB) to the server.
        """
        if self.config.lora is not None:
            return await super().join_sync_group(host, port, rank, world_size, collective)
        await self._started()
        body = {
            "master_address": host,
            "master_port": port,
            "rank_offset": rank,
            "world_size": world_size,
            "group_name": group_name(port),
            "backend": collective,
        }
        if self._group_name is not None:  # a re-formed group (respawned engine or trainer): leave the old one first
            await self.server.call("/destroy_weights_update_group", {"group_name": self._group_name})
            self._group_name = None
        await self.server.call("/init_weights_update_group", body)
        self._group_name = group_name(port)

    async def _receive_broadcast(
        self, plan: SyncPlan, version: int, verify: bool, in_flight: str, sample: int | None = None
    ) -> dict:
        """The server receives every bucket of ``plan`` from group rank 0 and loads it; then ``version`` is set.

        Returns:
            ``{"engine_id", "seconds", "checksum"}``; the probe checksum only if ``verify``.

        """
        if self.config.lora is not None:  # this actor is in the group: it receives the adapter
            return await self._load_adapter(plan, None, version, verify)
        if self._group_name is None:
            raise RuntimeError("receive_broadcast before join_sync_group")

        async def load() -> None:
            for i, bucket in enumerate(plan.buckets):
                last = i == len(plan.buckets) - 1
                body = {
                    "names": [m.name for m in bucket.tensors],
                    "dtypes": [str(bucket.dtype).removeprefix("torch.")] * len(bucket.tensors),
                    "shapes": [list(m.shape) for m in bucket.tensors],
                    "group_name": self._group_name,
                    "load_format": "flattened_bucket",
                    "flush_cache": last,
                }
                await self.server.call("/update_weights_from_distributed", body)

        return await self._update(load, plan, version, verify)

    async def _load_flats(
        self,
        plan: SyncPlan,
        flats: list[torch.Tensor],
        own: bool,
        version: int,
        verify: bool,
        in_flight: str,
        digests: dict[str, bytes] | None = None,
        sample: int | None = None,
    ) -> dict:
        """Load buckets (colocated sync) through ``/update_weights_from_tensor``.

        Each bucket is copied once into torch's shared memory, which the server maps: it takes tensors only as torch's
        pickled handles, which the trainer's buffers (memory files, ``sync.shm``) are not. ``digests`` go unused: the
        server's weights are checked by probe rows.

        Returns:
            As ``receive_broadcast``.

        """
        if self.config.lora is not None:
            return await self._load_adapter(plan, flats, version, verify)

        async def load() -> None:
            for i, (bucket, flat) in enumerate(zip(plan.buckets, flats)):
                # pickling views of torch shared memory shares the storage: the server maps the same bytes
                shared = flat if flat.is_shared() else _shared_copy(flat)
                blob = _serialized(unpack(bucket, shared.view(bucket.dtype)))
                body = {
                    "serialized_named_tensors": [blob] * self.config.tp_size,
                    "flush_cache": i == len(plan.buckets) - 1,
                }
                await self.server.call("/update_weights_from_tensor", body)

        return await self._update(load, plan, version, verify)

    async def _update(self, load, plan: SyncPlan, version: int, verify: bool) -> dict:
        if plan.adapter is not None:
            raise ValueError(
                "this SGLang engine takes full weights only, but the trainer has backend.lora set (adapter-only "
                "syncs): set SGLangEngineConfig.lora"
            )
        await self._started()
        start = time.perf_counter()
        await self._pause_server("in_place")
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
            if not self._user_paused:  # paused by the user before or during the load: it stays paused
                await self._resume_server()
        self._checksum = None
        if verify:
            self._checksum = probe_checksum(await self.server.weight_rows(plan.names))
        return {"engine_id": self.engine_id, "seconds": time.perf_counter() - start, "checksum": self._checksum}

    # --- adapter syncs (config.lora): this actor takes the adapter's buckets, the server loads them ---------------

    async def _load_adapter(self, plan: SyncPlan, flats: list | None, version: int, verify: bool) -> dict:
        """Load an adapter-only sync as a new SGLang adapter that new requests use.

        ``flats`` are the buckets of a colocated sync (``uint8``); None: they come over the broadcast group.
        """
        if plan.adapter is None:
            raise ValueError(
                "this SGLang engine has SGLangEngineConfig.lora set (adapter-only syncs), but the trainer sends full "
                "weights: set the trainer's backend.lora, or drop the engine's lora"
            )
        if flats is None and self._sync_group is None:
            raise RuntimeError("receive_broadcast before join_sync_group")
        self.config.lora.check_adapter(plan.adapter.rank, plan.adapter.target_modules)
        await self._started()
        start = time.perf_counter()

        def receive() -> list[tuple[str, torch.Tensor]]:  # each bucket lands in shared memory, copied at most once
            named = []
            for i, bucket in enumerate(plan.buckets):
                shared = shared_empty(bucket.nbytes)
                if flats is None:
                    self._sync_group.broadcast(shared)
                else:
                    shared.copy_(flats[i])
                named += unpack(bucket, shared.view(bucket.dtype))
            return named

        named = await asyncio.to_thread(receive)
        name = f"{self.server.model_name}-v{version}"
        if self._unloading is not None:  # at most one adapter besides the current one
            await self._unloading
        body = {
            "lora_name": name,
            "config_dict": _peft_config(plan.adapter),
            "serialized_named_tensors": [_serialized(dict(named))] * self.config.tp_size,
            "expected_checksums": {n: tensor_sha256(t) for n, t in named},
        }
        await self.server.call("/load_lora_adapter_from_tensors", body)  # every TP rank checks every sha256
        self._checksum = named_tensors_checksum(named) if verify else None
        old = self._adapter
        self._adapter = name  # new requests use the new adapter
        self._version = version
        if old is not None:  # SGLang unloads it once the requests that started on it are done
            self._unloading = asyncio.ensure_future(self.server.call("/unload_lora_adapter", {"lora_name": old}))
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


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` tensor copied once into shared memory."""
    return shared_empty(tensor.nbytes).copy_(tensor)


def _serialized(obj) -> str:
    """``obj`` (tensors in a list or dict) as SGLang's ``MultiprocessingSerializer`` sends it (pickled handles)."""
    from multiprocessing.reduction import ForkingPickler

    return base64.b64encode(ForkingPickler.dumps(obj)).decode()


def _peft_config(spec: AdapterSpec) -> dict:
    """The adapter's peft ``adapter_config.json`` as SGLang reads it (its scaling is ``lora_alpha / r``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.scaling * spec.rank,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "lora_dropout": 0.0,
    }


__all__ = ["SGLangEngineActor"]
