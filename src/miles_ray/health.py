"""HealthMonitor: an actor that watches every actor of a stack, replaces engines that stop serving, reports it all.

Each round (every ``interval_s``, and on ``check()``):

- engines: ``health()`` must answer within ``timeout_s``. Engines answer while generating; one whose stepping
  thread or server process died raises ``EngineDeadError``, a dead actor ``RayActorError``, a hung one times out.
  An engine failing ``max_failures`` rounds in a row is replaced by ``fault.heal_engines`` (respawned on its slot,
  or on a spare node if its node is lost; the trainer's current weights loaded and verified; routed to again).
- every other actor (trainer group and its ranks, pool, router, buffer, broadcaster, critic, reference): a death
  watch, one ping kept in flight per actor. It fails once the actor is dead (process exit, node loss) and only
  waits while the actor is busy, so a long train step is not mistaken for a failure. A dead trainer rank is
  reported, not replaced: the group's collectives are broken and the run rolls back to a checkpoint
  (``fault.restart_trainer`` + ``RunCheckpointer.load``), which is the driver's call.

The state is in ``stats()`` and in the Prometheus metrics ``actor_healthy{actor}`` (1 healthy, 0 not),
``health_replacements_total{role}`` and ``health_rounds_total``.

Usage (``StackConfig.health`` starts one with the stack)::

    monitor = HealthMonitor.options(name="miles_ray/health_monitor").remote(HealthMonitorConfig(), stack)
    ray.get(monitor.stats.remote())["actors"]["engine0"]   # {"healthy": True, "failures": 0}
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray
from pydantic import Field
from ray.exceptions import RayActorError

from miles_ray import metrics as mx
from miles_ray.config import StrictConfig
from miles_ray.fault import heal_engines

log = logging.getLogger(__name__)


class HealthMonitorConfig(StrictConfig):
    """How often to check, how long an engine may take to answer, when to replace it."""

    interval_s: float = Field(5.0, gt=0.0, le=3600.0, description="Seconds between check rounds.")
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="An engine health check slower than this fails.")
    max_failures: int = Field(2, ge=1, le=1000, description="Failed engine checks in a row before it is replaced.")
    replace_engines: bool = Field(True, description="Replace failed engines (fault.heal_engines); False: report only.")


def _pong(_actor) -> bool:
    return True


@ray.remote(num_cpus=0, max_concurrency=4)
class HealthMonitor:
    """Checks a ``Stack``'s actors every ``interval_s`` on a thread of its own; ``check()`` runs a round now."""

    def __init__(self, config: HealthMonitorConfig, stack):
        self.config = config
        self._stack = stack
        self._engines: list = list(stack.engines)
        self._ranks: list = []
        self._refresh: dict[str, Any] = {}  # in-flight pool.engines() / trainer.workers() calls
        self._pings: dict[str, tuple[Any, Any]] = {}  # actor name -> (handle, its ping in flight)
        self._failures: dict[str, int] = {}
        self._replaced: list[int] = []
        self._errors: list[str] = []
        self._rounds = 0
        self._snapshot: dict = {"rounds": 0, "actors": {}}
        self._lock = threading.Lock()  # one round at a time (the background one or a check() call)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="health-monitor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.check()
            except Exception:  # the loop must outlive any one round, or nothing is watched again
                log.exception("health check round failed")

    def check(self) -> dict[str, bool]:
        """Run one round now (replacing engines that failed ``max_failures`` rounds); returns actor -> healthy."""
        with self._lock:
            self._refresh_handles()
            healthy = self._check_engines()
            for name, actor in self._watched().items():
                healthy[name] = self._watch(name, actor)
            for name, ok in healthy.items():
                self._failures[name] = 0 if ok else self._failures.get(name, 0) + 1
                mx.gauge("actor_healthy", "1 if the actor answers its health check", ("actor",)).set(
                    int(ok), tags={"actor": name}
                )
            self._rounds += 1
            actors = {n: {"healthy": ok, "failures": self._failures[n]} for n, ok in healthy.items()}
            self._snapshot = {"rounds": self._rounds, "actors": actors}
            mx.counter("health_rounds_total", "Health monitor check rounds").inc()
            failed = [i for i in range(len(self._engines)) if self._failures[f"engine{i}"] >= self.config.max_failures]
            if failed and self.config.replace_engines:
                self._replace(failed)
            return dict(healthy)

    def _refresh_handles(self) -> None:
        """Pick up respawned engines and restarted ranks without blocking on a busy pool or trainer group."""
        sources = {"engines": self._stack.pool.engines, "ranks": self._stack.trainer.workers}
        for key, method in sources.items():
            ref = self._refresh.get(key)
            if ref is None:
                self._refresh[key] = method.remote()
                continue
            if ray.wait([ref], timeout=0)[0]:
                del self._refresh[key]
                try:
                    setattr(self, f"_{key}", list(ray.get(ref)))
                except RayActorError:
                    pass  # the pool or trainer group is dead: its own watch reports it

    def _check_engines(self) -> dict[str, bool]:
        probes = [e.health.remote() for e in self._engines]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=self.config.timeout_s)
        out = {}
        for i, probe in enumerate(probes):
            try:
                out[f"engine{i}"] = probe in ready and bool(ray.get(probe))
            except Exception:  # RayActorError, EngineDeadError (the stepping thread or server died)
                out[f"engine{i}"] = False
        return out

    def _watched(self) -> dict[str, Any]:
        roles = {k: v for k, v in self._stack.actors().items() if not k.startswith("engine") and k != "monitor"}
        roles.update({f"trainer_rank{i}": w for i, w in enumerate(self._ranks)})
        return roles

    def _watch(self, name: str, actor) -> bool:
        """False once ``actor`` is dead; True while it answers or is busy (its ping still queued)."""
        held, ping = self._pings.get(name, (None, None))
        if held != actor:  # first round, or a new actor under this name (a restarted rank)
            held, ping = actor, actor.__ray_call__.remote(_pong)
        if not ray.wait([ping], timeout=0)[0]:
            self._pings[name] = (held, ping)
            return True
        try:
            ray.get(ping)
        except RayActorError:
            self._pings[name] = (held, ping)  # stays dead until a new actor takes the name
            return False
        self._pings[name] = (held, actor.__ray_call__.remote(_pong))
        return True

    def _replace(self, failed: list[int]) -> None:
        """``heal_engines``, then again with the newer version if a train step landed meanwhile.

        The weights a new engine gets are the trainer's at the time they are pulled, so if the trainer's version
        moved while healing, the engine may hold the newer weights under the older number: push again as the newer.
        """
        trainer, broadcaster = self._stack.trainer, self._stack.broadcaster
        try:
            version = ray.get(trainer.weight_version.remote())
            healed = heal_engines(self._stack.pool, broadcaster, self._stack.router, version, self.config.timeout_s)
            engines = ray.get(self._stack.pool.engines.remote())
            while (now := ray.get(trainer.weight_version.remote())) != version:
                ray.get([broadcaster.replace_engine.remote(i, engines[i], now) for i in healed])
                version = now
        except Exception as exc:  # a dead trainer rank, no spare left: report and try again next round
            self._errors = [*self._errors[-9:], f"{time.strftime('%H:%M:%S')} replacing engines {failed}: {exc!r}"]
            log.warning("could not replace engines %s: %r", failed, exc)
            return
        self._engines = engines
        for i in healed:
            self._failures[f"engine{i}"] = 0
        self._replaced.extend(healed)
        if healed:
            mx.counter("health_replacements_total", "Actors replaced by the health monitor", ("role",)).inc(
                len(healed), tags={"role": "engine"}
            )

    def stats(self) -> dict:
        """Rounds run, each actor's state after the last round, the engines replaced, the last errors.

        Per actor: ``healthy`` and ``failures`` (in a row); ``replaced``: engine ids, in order. Answers at once, also
        while a round runs.
        """
        return {**self._snapshot, "replaced": list(self._replaced), "errors": list(self._errors)}

    def stop(self) -> None:
        """End the background rounds (``check()`` still runs one on demand)."""
        self._stop.set()
        self._thread.join(timeout=self.config.interval_s + self.config.timeout_s)
