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
from typing import Any, Literal, get_args

import ray
import torch
from pydantic import Field, field_validator, model_validator

from miles_ray import metrics as mx
from miles_ray.config import StrictConfig
from miles_ray.engines.base import Completion, GenerateOutput, GenerateRequest
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.sglang import SGLangEngineConfig
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.placement.groups import Placement
from miles_ray.sync.plan import SyncPlan, unpack
from miles_ray.sync.shm import as_tensor

InFlight = Literal["continue", "finish", "abort_resume"]
IN_FLIGHT_MODES = get_args(InFlight)


class RolloutPoolConfig(StrictConfig):
    """How many engines, of which kind, and whether they serve HTTP."""

    num_engines: int = Field(1, ge=1, le=4096, description="Engine actors in the pool (one per engine slot).")
    engine: EmbeddedEngineConfig | VLLMEngineConfig | SGLangEngineConfig = Field(
        ..., description="Per-engine config, selected by `kind` (embedded, the default when omitted | vllm | sglang)."
    )
    http: HttpServerConfig | None = Field(
        None,
        description="Start each embedded engine's HTTP server (SGLang-native + OpenAI API); None: Ray calls only. "
        "vLLM and SGLang engines always serve their own API.",
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _select_engine(cls, value: Any) -> Any:
        # dispatch on `kind` by hand rather than a pydantic tagged union: `kind` may be omitted (embedded, as
        # before vLLM existed) and errors keep the plain path (`engine.num_threads`, not `engine.embedded....`)
        if not isinstance(value, dict):
            return value
        configs = {"embedded": EmbeddedEngineConfig, "vllm": VLLMEngineConfig, "sglang": SGLangEngineConfig}
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
    load in ``_load(run, plan, version, verify, in_flight)``, which runs ``run`` and returns ``{"engine_id", "seconds",
    "checksum"}``.
    """

    engine_id: int
    _sync_group = None
    accepts_adapters = True  # takes LoRA-only syncs (SyncPlan.adapter)
    accepts_full_weights = True  # takes syncs of every weight

    async def checksum_kind(self) -> str:
        """``full``: the sync checksum covers every byte the engine holds (SGLang engines: ``probe``)."""
        return "full"

    async def sync_ranks(self) -> int:
        """Ranks this engine adds to the broadcast group (an SGLang server: its TP size)."""
        return 1

    async def takes_adapters(self) -> bool:
        """Whether this engine can load an adapter-only sync (the broadcaster asks before the first sync)."""
        return self.accepts_adapters

    async def takes_full_weights(self) -> bool:
        """Whether this engine can load a sync of all weights (an SGLang engine serving LoRA adapters cannot)."""
        return self.accepts_full_weights

    async def release_memory(self) -> bool:
        """Free the engine's accelerator memory while a colocated trainer trains; False: nothing to free here.

        Only SGLang engines started with ``enable_memory_saver`` free anything; other engines keep theirs.
        """
        return False

    async def resume_memory(self, tags: str | list[str] | None = None) -> bool:
        """Take the memory of ``release_memory`` back (``tags``: ``weights`` / ``kv_cache``; None: all)."""
        return False

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    async def _load(self, run, plan: SyncPlan, version: int, verify: bool, in_flight: InFlight) -> dict:
        raise NotImplementedError

    async def join_sync_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group used for disaggregated weight sync."""
        from miles_ray.sync.gloo import BroadcastGroup

        self._sync_group = await asyncio.to_thread(BroadcastGroup.create, host, port, rank, world_size, backend)

    async def receive_broadcast(
        self, plan: SyncPlan, version: int, verify: bool = True, in_flight: InFlight = "continue"
    ) -> dict:
        """Receive every bucket of ``plan`` from group rank 0 and load it; then set ``version``.

        ``in_flight`` says what happens to requests generating meanwhile (``WeightBroadcasterConfig.in_flight``).

        Returns:
            ``{"engine_id", "seconds", "checksum"}``; the checksum (of the weights now held) only if ``verify``.

        """
        if self._sync_group is None:
            raise RuntimeError("receive_broadcast before join_sync_group")

        def run() -> None:
            for bucket in plan.buckets:
                flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
                self._sync_group.broadcast(flat)
                self._apply(unpack(bucket, flat.view(bucket.dtype)))

        return await self._load(run, plan, version, verify, in_flight)

    async def load_buckets(
        self,
        plan: SyncPlan,
        bucket_refs: list[ray.ObjectRef],
        version: int,
        verify: bool = True,
        in_flight: InFlight = "continue",
    ) -> dict:
        """Load buckets from the object store (colocated sync; zero-copy reads); then set ``version``.

        Returns:
            As ``receive_broadcast``.

        """
        arrays = await asyncio.gather(*bucket_refs)  # mapped from shared memory, not copied

        def run() -> None:
            for bucket, array in zip(plan.buckets, arrays):
                self._apply(unpack(bucket, as_tensor(array, bucket.dtype)))

        return await self._load(run, plan, version, verify, in_flight)


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
        self._resume: set[str] = set()  # requests aborted by an `abort_resume` weight load, to continue after it
        self._loaded = asyncio.Event()  # clear while such a load runs
        self._loaded.set()

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request``; it joins the engine's running batch (continuous batching).

        Raises:
            ValueError: for an invalid request (the engine stays up).

        """
        self._outstanding += 1
        try:
            out = await self._generate_resumable(request)
        finally:
            self._outstanding -= 1
        out.engine_id = self.engine_id
        mx.counter("engine_generated_tokens_total", "Tokens generated", ("engine",)).inc(
            sum(len(c.token_ids) for c in out.completions), tags={"engine": str(self.engine_id)}
        )
        return out

    async def _generate_resumable(self, request: GenerateRequest) -> GenerateOutput:
        out = await self.loop.generate(request)
        while request.request_id in self._resume:  # aborted by a weight load: continue on the new weights
            self._resume.discard(request.request_id)
            await self._loaded.wait()
            out = await self._continue(request, out)
        return out

    async def _continue(self, request: GenerateRequest, out: GenerateOutput) -> GenerateOutput:
        """Continue every aborted completion of ``out`` from its last token (a partial rollout).

        Each continuation is a request of its own for the remaining tokens, with the prompt followed by the
        tokens so far as its prompt (re-prefilled under the new weights); tokens and logprobs are concatenated.
        """
        p, parts = request.params, {}
        for i, c in enumerate(out.completions):
            remaining = p.max_new_tokens - len(c.token_ids)
            if c.finish_reason != "abort" or remaining < 1:
                continue
            seed = None if p.seed is None else p.seed * 7919 + 31 * i + len(c.token_ids)
            params = p.model_copy(update={"n": 1, "max_new_tokens": remaining, "seed": seed})
            rid = f"{request.request_id}/resume{i}@{len(c.token_ids)}"
            parts[i] = GenerateRequest(list(request.prompt_ids) + list(c.token_ids), params, request_id=rid)
        outs = await asyncio.gather(*(self._generate_resumable(r) for r in parts.values()))
        for i, more in zip(parts, outs):
            c, tail = out.completions[i], more.completions[0]
            tokens = list(c.token_ids) + list(tail.token_ids)
            text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
            # the continuation re-prefilled prompt + tokens so far: its routes cover the whole sequence
            routes = tail.routes if tail.routes is not None else c.routes
            out.completions[i] = Completion(
                tokens, list(c.logprobs) + list(tail.logprobs), tail.finish_reason, text, routes
            )
            out.weight_version = max(out.weight_version, more.weight_version)
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

    async def _load(self, run, plan: SyncPlan, version: int, verify: bool, in_flight: InFlight) -> dict:
        # no decode step may see half-updated weights: the engine is paused around the load. Requests in
        # flight: `continue` keeps them in their slots and they go on with the new weights; `finish` admits no
        # new request and waits until the running ones are done on the old weights; `abort_resume` aborts them
        # and continues each from its last token once the new weights are in (`generate` does it).
        if in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        was_paused = self.engine.paused
        start = time.perf_counter()
        if in_flight == "finish" and not was_paused:
            self.engine.hold_admission(True)
            while self.engine.num_running():
                await asyncio.sleep(0.002)
        elif in_flight == "abort_resume":
            self._loaded.clear()
            self._resume |= self.engine.request_ids()
        drained = time.perf_counter()
        await self.loop.pause("abort" if in_flight == "abort_resume" else "in_place")
        try:
            if plan.adapter is not None:  # a LoRA sync: the adapters exist from the first one on
                self.engine.install_adapter(plan.adapter)
            await asyncio.to_thread(run)
            self.engine.set_weight_version(version)
        finally:
            self.engine.hold_admission(False)
            self._loaded.set()
            if not was_paused:
                self.loop.resume()
        seconds = time.perf_counter() - drained
        # hashing here, right after loading, runs in parallel with the trainer's hash of what it sent
        # an adapter sync is verified on the adapter tensors; the base weights never change
        names = plan.names if plan.adapter is not None else None
        checksum = await asyncio.to_thread(self.engine.weights_checksum, names) if verify else None
        return {"engine_id": self.engine_id, "seconds": seconds, "checksum": checksum, "drain_seconds": drained - start}


@ray.remote(num_cpus=0)
class RolloutPool:
    """Creates and owns the engine actors of a run (one per ``placement.plan.engine_slots`` entry)."""

    def __init__(self, config: RolloutPoolConfig, placement: Placement):
        self.config = config
        self._placement = placement
        if config.engine.kind == "vllm":
            from miles_ray.actors.vllm_engine import VLLMEngineActor

            self._cls, self._args = VLLMEngineActor, lambda i: (i, config.engine, config.served_model_name)
        elif config.engine.kind == "sglang":
            from miles_ray.actors.sglang_engine import SGLangEngineActor

            self._cls, self._args = SGLangEngineActor, lambda i: (i, config.engine, config.served_model_name)
        else:
            self._cls, self._args = EngineActor, lambda i: (i, config.engine)
        self._engines = placement.spawn(
            self._cls, "engine", "RolloutPoolConfig.num_engines", config.num_engines, self._args, max_concurrency=1000
        )
        self._urls = self._start(self._engines)
        self._respawned = 0

    def _start(self, engines: list) -> list[str] | None:
        # fail at setup, not on the first request: wait until every engine has loaded its model
        health = ray.get([e.health.remote() for e in engines])
        if self.config.engine.kind in ("vllm", "sglang"):  # server-backed: each serves its own HTTP API
            return [h["url"] for h in health]
        if self.config.http is not None:
            return ray.get([e.start_http.remote(self.config.http, self.config.served_model_name) for e in engines])
        return None

    def respawn_dead(self, health_timeout_s: float = 60.0) -> dict[int, Any]:
        """Replace every engine that is dead (or does not answer a health check in time) on its own slot.

        A hung engine is killed first. The new engine loads the model from ``engine.model_path`` (weight
        version 0): give it the current weights (``WeightBroadcaster.replace_engine``) before routing to it;
        ``miles_ray.fault.heal_engines`` does all three steps.

        Returns:
            engine id -> the new engine's handle, for the engines replaced (empty if all were alive).

        """
        probes = [e.health.remote() for e in self._engines]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=health_timeout_s)
        dead = []
        for i, probe in enumerate(probes):
            try:
                if probe not in ready:
                    raise TimeoutError
                ray.get(probe)
            except (ray.exceptions.RayActorError, TimeoutError):
                ray.kill(self._engines[i], no_restart=True)  # a hung engine must not come back beside its successor
                dead.append(i)
        new = {i: self._placement.spawn_one(self._cls, "engine", i, self._args(i), max_concurrency=1000) for i in dead}
        urls = self._start(list(new.values())) if new else None
        for k, (i, engine) in enumerate(new.items()):
            self._engines[i] = engine
            if urls is not None:
                self._urls[i] = urls[k]
        self._respawned += len(new)
        return new

    def release_memory(self) -> list[bool]:
        """Every engine frees its accelerator memory (colocated, before a train step); per engine: whether it did.

        Call it when no request is in flight (after the rollout). Then ``resume_memory("weights")``, the weight
        sync, and ``resume_memory("kv_cache")``, so the new weights land before the KV cache is allocated again.
        """
        return ray.get([e.release_memory.remote() for e in self._engines])

    def resume_memory(self, tags: str | list[str] | None = None) -> list[bool]:
        """Every engine takes back the memory ``tags`` (``weights``, ``kv_cache``; None: all) of ``release_memory``."""
        return ray.get([e.resume_memory.remote(tags) for e in self._engines])

    def num_respawned(self) -> int:
        """Engines replaced by ``respawn_dead`` so far."""
        return self._respawned

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
