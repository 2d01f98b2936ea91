"""Router: an async actor that load-balances generate requests over engines, health-checks and evicts.

Policies: ``round_robin`` and ``least_outstanding`` (fewest in-flight requests sent by this router).
An engine that dies mid-request (``RayActorError``, or ``EngineDeadError``: its stepping thread or server process
is gone while the actor lives) is evicted at once and the request is retried on another engine; an engine that
fails ``max_health_failures`` health checks in a row (no answer in time, or an error) is evicted too.
Evicted engines get no more traffic until ``add_engine`` puts one (e.g. a respawned engine) back.

Usage::

    router = Router.options(name="miles_ray/router").remote(RouterConfig(), engines)
    out = await router.generate.remote(GenerateRequest(prompt_ids=ids, params=SamplingParams(n=4)))
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Literal

import ray
from pydantic import Field
from ray.exceptions import RayActorError

from miles_ray import metrics as mx
from miles_ray.config import StrictConfig
from miles_ray.engines.requests import EngineDeadError, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)


class RouterConfig(StrictConfig):
    """Load-balancing and health-check policy."""

    policy: Literal["round_robin", "least_outstanding"] = Field("least_outstanding", description="Engine choice.")
    health_interval_s: float = Field(5.0, gt=0.0, le=3600.0, description="Seconds between health-check rounds.")
    health_timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="A health check slower than this fails.")
    max_health_failures: int = Field(3, ge=1, le=1000, description="Consecutive failed checks before eviction.")
    max_retries: int = Field(3, ge=0, le=100, description="Retries of a request whose engine died.")


class NoHealthyEngineError(RuntimeError):
    """Raised when every engine has been evicted."""


@ray.remote(num_cpus=0)
class Router:
    """Dispatches requests to engine actors (async actor: thousands of requests in flight)."""

    def __init__(self, config: RouterConfig, engines: list):
        if not engines:
            raise ValueError("Router needs at least one engine handle")
        self.config = config
        self._engines: dict[int, object] = dict(enumerate(engines))
        self._outstanding = dict.fromkeys(self._engines, 0)
        self._failures = dict.fromkeys(self._engines, 0)
        self._evicted: set[int] = set()
        self._rr = itertools.count()
        self._health_task = None
        self._served = dict.fromkeys(self._engines, 0)
        self._retried = 0  # requests re-sent because their engine died

    def _healthy(self) -> list[int]:
        return [i for i in self._engines if i not in self._evicted]

    def _pick(self) -> int:
        healthy = self._healthy()
        if not healthy:
            raise NoHealthyEngineError("all engines are evicted")
        if self.config.policy == "round_robin":
            return healthy[next(self._rr) % len(healthy)]
        return min(healthy, key=lambda i: (self._outstanding[i], self._served[i]))

    def _ensure_health_loop(self) -> None:
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Send ``request`` to an engine chosen by the policy; retry elsewhere if that engine dies.

        Raises:
            NoHealthyEngineError: when no engine is left.
            ValueError: passed through from the engine for an invalid request.

        """
        self._ensure_health_loop()
        last_exc: Exception | None = None
        for _ in range(self.config.max_retries + 1):
            idx = self._pick()
            self._outstanding[idx] += 1
            self._served[idx] += 1
            self._depth(idx)
            try:
                return await self._engines[idx].generate.remote(request)
            except (RayActorError, EngineDeadError) as exc:  # Ray raises an actor's EngineDeadError as one
                last_exc = exc
                self._evict(idx)
                self._retried += 1
                mx.counter("router_retries_total", "Requests re-sent because their engine died").inc()
            finally:
                self._outstanding[idx] -= 1
                self._depth(idx)
        raise NoHealthyEngineError(f"request failed on {self.config.max_retries + 1} engines") from last_exc

    def _depth(self, idx: int) -> None:
        mx.gauge("router_outstanding", "Requests in flight per engine", ("engine",)).set(
            self._outstanding[idx], tags={"engine": str(idx)}
        )

    def _evict(self, idx: int) -> None:
        self._evicted.add(idx)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # the loop must outlive any one round, or nothing is ever evicted again
                log.exception("router health check round failed")
            await asyncio.sleep(self.config.health_interval_s)

    async def check_health(self) -> dict[int, bool]:
        """Run one health-check round now; returns engine id -> healthy."""
        ids = self._healthy()

        async def probe(i: int) -> bool:
            try:
                await asyncio.wait_for(self._engines[i].health.remote(), self.config.health_timeout_s)
                return True
            except Exception:  # dead actor, timeout, or a health() that raised (EngineDeadError, a bug)
                return False

        results = await asyncio.gather(*(probe(i) for i in ids))
        for i, ok in zip(ids, results):
            self._failures[i] = 0 if ok else self._failures[i] + 1
            if self._failures[i] >= self.config.max_health_failures:
                self._evict(i)
        return dict(zip(ids, results))

    async def add_engine(self, engine, engine_id: int | None = None) -> int:
        """Add (or replace, by id) an engine and route to it again. Returns its id."""
        idx = engine_id if engine_id is not None else max(self._engines, default=-1) + 1
        self._engines[idx] = engine
        self._outstanding.setdefault(idx, 0)
        self._served.setdefault(idx, 0)
        self._failures[idx] = 0
        self._evicted.discard(idx)
        return idx

    async def stats(self) -> dict:
        """Per-engine outstanding and served counts, which engines are evicted, requests retried after a death."""
        return {
            "outstanding": dict(self._outstanding),
            "served": dict(self._served),
            "evicted": sorted(self._evicted),
            "retried": self._retried,
        }
