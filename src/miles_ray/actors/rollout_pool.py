"""RolloutPool: a set of rollout engine actors, each on its placement slot, restarted on that slot when it dies.

The pool starts one engine actor per engine slot of the placement plan, of the kind its config names: embedded
(``EmbeddedEngineActor``, the default), vLLM (``VLLMEngineActor``) or SGLang (``SGLangEngineActor``); every one
implements ``actors.engine_actor.EngineInterface``, so the Router and the WeightBroadcaster drive them alike.

Usage::

    pool = RolloutPool.options(name="miles_ray/rollout_pool").remote(RolloutPoolConfig(...), placement)
    engines = ray.get(pool.engines.remote())

The pool owns its engines (Ray fate-sharing): keep the pool handle, or name the pool, for as long as the
engines are used; an unnamed pool whose last handle is dropped takes its engines with it.
"""

from __future__ import annotations

from typing import Any

import ray
from pydantic import Field, model_validator

from miles_ray.actors.embedded_engine import EmbeddedEngineActor
from miles_ray.actors.sglang_engine import SGLangEngineActor
from miles_ray.actors.vllm_engine import VLLMEngineActor
from miles_ray.config import StrictConfig, kind_union
from miles_ray.engines.embedded import EmbeddedEngineConfig
from miles_ray.engines.http_server import HttpServerConfig
from miles_ray.engines.requests import DEFAULT_MODEL_NAME, EngineDeadError
from miles_ray.engines.sglang import SGLangEngineConfig
from miles_ray.engines.vllm import VLLMEngineConfig
from miles_ray.placement.groups import Placement

EngineConfig = kind_union(EmbeddedEngineConfig, VLLMEngineConfig, SGLangEngineConfig, default="embedded")
# the engine actor class of each engine kind
ENGINE_ACTORS = {"embedded": EmbeddedEngineActor, "vllm": VLLMEngineActor, "sglang": SGLangEngineActor}


class RolloutPoolConfig(StrictConfig):
    """How many engines, of which kind, and whether they serve HTTP."""

    num_engines: int = Field(1, ge=1, le=4096, description="Engine actors in the pool (one per engine slot).")
    engine: EngineConfig = Field(
        ..., description="Per-engine config, selected by `kind` (embedded, the default when omitted | vllm | sglang)."
    )
    http: HttpServerConfig | None = Field(
        None,
        description="Start each embedded engine's HTTP server (SGLang-native + OpenAI API); None: Ray calls only. "
        "vLLM and SGLang engines always serve their own API.",
    )
    served_model_name: str = Field(DEFAULT_MODEL_NAME, description="Model name the OpenAI routes report and accept.")

    @model_validator(mode="after")
    def _check_http(self) -> RolloutPoolConfig:
        if self.http is not None and self.engine.kind != "embedded":
            raise ValueError(f"http applies to embedded engines; engine.kind={self.engine.kind!r} serves its own")
        return self


@ray.remote(num_cpus=0)
class RolloutPool:
    """Creates and owns the engine actors of a run (one per ``placement.plan.engine_slots`` entry)."""

    def __init__(self, config: RolloutPoolConfig, placement: Placement):
        self.config = config
        self._placement = placement
        self._cls = ENGINE_ACTORS[config.engine.kind]
        self._engines = placement.spawn(
            self._cls, "engine", "RolloutPoolConfig.num_engines", config.num_engines, self._args, max_concurrency=1000
        )
        self._urls = self._start(self._engines)
        self._respawned = 0

    def _args(self, engine_id: int) -> tuple:
        """Constructor arguments of engine ``engine_id`` (every engine actor takes the same)."""
        return engine_id, self.config.engine, self.config.served_model_name

    def _start(self, engines: list) -> list[str] | None:
        # fail at setup, not on the first request: wait until every engine has loaded its model
        health = ray.get([e.health.remote() for e in engines])
        if self.config.engine.kind in ("vllm", "sglang"):  # server-backed: each serves its own HTTP API
            return [h["url"] for h in health]
        if self.config.http is not None:
            return ray.get([e.start_http.remote(self.config.http, self.config.served_model_name) for e in engines])
        return None

    def respawn_dead(self, health_timeout_s: float = 60.0) -> dict[int, Any]:
        """Replace every dead engine on its own slot.

        Dead: its actor died, its health check raises ``EngineDeadError`` (the stepping thread or the server process
        is gone), or it does not answer in time.

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
            except (ray.exceptions.RayActorError, EngineDeadError, TimeoutError):
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

    def add_engine(self, node_id: str) -> tuple[int, Any]:
        """Start one more engine, on node ``node_id`` (say a node added to the cluster), shaped like the others.

        It gets the next engine id and is respawned like the plan's engines (on a spare node if its node is lost).
        It holds the model at ``engine.model_path`` (version 0): ``miles_ray.fault.grow_pool`` gives it the current
        weights and routes to it.

        Returns:
            ``(engine_id, handle)``.

        Raises:
            RuntimeError: if the node is not alive or has no room for an engine.

        """
        engine_id = self._placement.add_slot("engine", node_id)
        engine = self._placement.spawn_one(self._cls, "engine", engine_id, self._args(engine_id), max_concurrency=1000)
        urls = self._start([engine])
        self._engines.append(engine)
        if urls is not None:
            self._urls.append(urls[0])
        return engine_id, engine

    def release_memory(self) -> list[bool]:
        """Every engine frees its accelerator memory (colocated, before a train step); per engine: whether it did.

        Call it when no request is in flight (after the rollout). Then ``resume_memory("weights")``, the weight
        sync, and ``resume_memory("kv_cache")``, so the new weights land before the KV cache is allocated again.
        """
        return ray.get([e.release_memory.remote() for e in self._engines])

    def resume_memory(self, tags: str | list[str] | None = None) -> list[bool]:
        """Every engine takes back the memory ``tags`` (``weights``, ``kv_cache``; None: all) of ``release_memory``."""
        return ray.get([e.resume_memory.remote(tags) for e in self._engines])

    def placement(self) -> Placement:
        """The placement the pool's engines run on (``stack.attach_stack`` rebuilds a ``Stack`` from it)."""
        return self._placement

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

    def api_key(self) -> str:
        """The bearer token of the engines' HTTP servers (one for the pool; random unless ``http.api_key`` was given).

        Raises:
            RuntimeError: if the pool's engines serve no HTTP.

        """
        if self.config.http is None:
            raise RuntimeError("RolloutPoolConfig.http is None: the engines serve no HTTP")
        return self.config.http.api_key.get_secret_value()

    def num_engines(self) -> int:
        """How many engines the pool runs."""
        return len(self._engines)
