"""EmbeddedEngineActor: one embedded (pure-PyTorch) engine as an async Ray actor behind the engine-actor interface.

``generate`` calls join the engine's running batch (continuous batching, stepped on a worker thread by
``EngineLoop`` so ``health`` keeps answering), and with ``RolloutPoolConfig.http`` the same engine also serves
SGLang-native and OpenAI HTTP routes. It receives weight buckets over a broadcast group (disaggregated) or the
object store (colocated), pausing decode in place while a sync loads so no step sees half-updated weights; every
``in_flight`` mode is supported (``continue``, ``finish``, ``abort_resume``: aborted requests continue from their
last token on the new weights, a partial rollout).

Usage (the pool creates these; a driver talks to them through the Router)::

    pool = RolloutPool.remote(RolloutPoolConfig(engine=EmbeddedEngineConfig(model_path=p)), placement)
    engine = ray.get(pool.engines.remote())[0]
    ray.get(engine.pause.remote("in_place"))
"""

from __future__ import annotations

import asyncio
import time

import ray
import torch

from miles_ray import metrics as mx
from miles_ray.actors.engine_actor import EngineActorBase, InFlight
from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.requests import DEFAULT_MODEL_NAME, Completion, GenerateOutput, GenerateRequest, PauseMode
from miles_ray.engines.sampling import cut_at_stop
from miles_ray.sync.buckets import SyncPlan


class EmbeddedEngineActor(EngineActorBase):
    """One embedded engine as an async actor (apply ``ray.remote`` via ``RolloutPool``)."""

    kind = "embedded"
    samples_checksum = True  # hashes its parameters itself (``engines.embedded``)

    def __init__(self, engine_id: int, config: EmbeddedEngineConfig, served_model_name: str = DEFAULT_MODEL_NAME):
        self.engine_id = engine_id
        self.served_model_name = served_model_name  # what its HTTP routes (start_http) report
        self.engine = EmbeddedEngine(config)
        self.loop = EngineLoop(self.engine)
        self._outstanding = 0
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
            prompt, resumed = list(request.prompt_ids) + list(c.token_ids), request.resumed + len(c.token_ids)
            parts[i] = GenerateRequest(prompt, params, request_id=rid, resumed=resumed)
        outs = await asyncio.gather(*(self._generate_resumable(r) for r in parts.values()))
        for i, more in zip(parts, outs):
            c, tail = out.completions[i], more.completions[0]
            tokens = list(c.token_ids) + list(tail.token_ids)
            text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
            text = cut_at_stop(text, tail.stop_reason)
            # the continuation re-prefilled prompt + tokens so far: its routes cover the whole sequence
            routes = tail.routes if tail.routes is not None else c.routes
            out.completions[i] = Completion(
                tokens, list(c.logprobs) + list(tail.logprobs), tail.finish_reason, text, routes, tail.stop_reason
            )
            out.weight_version = max(out.weight_version, more.weight_version)
        return out

    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request (all if None); its caller gets what was generated so far."""
        self.loop.abort(request_id)

    async def _pause(self, mode: PauseMode) -> None:
        await self.loop.pause(mode)  # see EmbeddedEngine.pause

    async def resume(self) -> None:
        """Continue after ``pause``."""
        self.loop.resume()

    async def flush_cache(self) -> None:
        """Nothing to drop: the embedded engine shares a prefix only within one request (no cross-request cache)."""

    async def start_http(self, config: HttpServerConfig, model_name: str | None = None) -> str:
        """Serve this engine over HTTP (same running batch as Ray calls); returns the base URL.

        ``model_name`` is the name the OpenAI routes report; None: the served model name the engine was started with.
        """
        from miles_ray.engines.http_server import start_server

        if self._http is None:
            self._http, self.url = await start_server(self.loop, model_name or self.served_model_name, config)
        return self.url

    async def health(self) -> dict:
        """Liveness plus load: queue depth and the loaded weight version.

        Raises:
            EngineDeadError: if the engine's stepping thread has died (the Router then evicts this engine).

        """
        self.loop.check_alive()
        return {
            "engine_id": self.engine_id,
            "outstanding": self._outstanding,
            "version": self.engine.weight_version(),
            "url": self.url,
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "step_errors": self.loop.step_errors,
            **self.engine.stats(),
        }

    # --- weights --------------------------------------------------------------------------------
    async def weight_version(self) -> int:
        """Version of the loaded weights."""
        return self.engine.weight_version()

    async def weights_dtype(self) -> str:
        """The dtype the engine computes in (``auto`` resolved on this engine's device)."""
        return str(self.engine.dtype).removeprefix("torch.")

    async def weights_checksum(self, sample: int | None = None) -> str:
        """Checksum of the loaded weights, read again (``sample``: the sampled digest, ``sync.digest``)."""
        return await asyncio.to_thread(self.engine.weights_checksum, None, None, sample)

    def _apply(self, named_tensors: list[tuple[str, torch.Tensor]], alias: bool = False) -> None:
        self.engine.update_weights(named_tensors, alias=alias)

    async def _load(
        self, run, plan: SyncPlan, version: int, verify: bool, in_flight: InFlight, known=None, sample=None
    ) -> dict:
        # no decode step may see half-updated weights: the engine is paused around the load. Requests in
        # flight: `continue` keeps them in their slots and they go on with the new weights; `finish` admits no
        # new request and waits until the running ones are done on the old weights; `abort_resume` aborts them
        # and continues each from its last token once the new weights are in (`generate` does it).
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
        # an adapter sync is verified on the adapter tensors; the base weights never change. Parameters that view
        # the received buckets take the buckets' digests (`known`); the rest are read again here
        names = plan.names if plan.adapter is not None else None
        checksum = await asyncio.to_thread(self.engine.weights_checksum, names, known, sample) if verify else None
        return {"engine_id": self.engine_id, "seconds": seconds, "checksum": checksum, "drain_seconds": drained - start}
