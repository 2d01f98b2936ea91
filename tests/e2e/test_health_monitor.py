"""The HealthMonitor (#22): every actor of a stack watched; an engine that died, whose stepping thread died while
its actor lives, or that hangs (health() never answers), is replaced with the trainer's current weights without
the driver doing anything; a dead trainer rank is reported; all of it in ``stats()`` and in the Prometheus metrics.
Faults are injected for real (``ray.kill``; the stepping thread ended as a fatal bug would end it; the engine's
event loop blocked)."""

import time

import pytest
import ray
from helpers import stop_stepping, synthetic_group, tiny_stack, trainer_checksum

from miles_ray import placement
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.metrics import scrape

pytestmark = pytest.mark.e2e


def wait_for(condition, what: str, timeout_s: float = 90.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"{what} not within {timeout_s}s")


def test_the_monitor_replaces_failed_engines_with_current_weights_and_reports_a_dead_rank(
    ray_cluster, make_placement, tiny_model_path
):
    pl = make_placement(placement.disaggregated(1, 2))
    health = {"interval_s": 0.5, "timeout_s": 5.0, "max_failures": 1}
    router = {"policy": "round_robin", "health_interval_s": 3600}  # the monitor alone notices the failures
    stack = tiny_stack(pl, tiny_model_path, num_engines=2, router=router, health=health)
    monitor = stack.monitor
    try:
        version = ray.get(stack.trainer.train_step.remote(synthetic_group(1)))["weight_version"]
        ray.get(stack.broadcaster.sync.remote(version))
        watched = {"trainer", "trainer_rank0", "pool", "router", "buffer", "broadcaster", "engine0", "engine1"}

        def all_healthy():
            actors = ray.get(monitor.stats.remote())["actors"]
            return set(actors) == watched and all(a["healthy"] for a in actors.values())

        wait_for(all_healthy, "every actor healthy")

        ray.kill(stack.engines[0], no_restart=True)  # the actor dies
        wait_for(lambda: ray.get(monitor.stats.remote())["replaced"] == [0], "engine 0 replaced")
        assert stop_stepping(stack.engines[1]) is False  # the actor lives, its engine does not
        wait_for(lambda: ray.get(monitor.stats.remote())["replaced"] == [0, 1], "engine 1 replaced")

        hung = ray.get(stack.pool.engines.remote())[0]
        hung.__ray_call__.remote(lambda _: time.sleep(3600))  # blocks the engine's event loop: health() never answers
        wait_for(lambda: ray.get(monitor.stats.remote())["replaced"] == [0, 1, 0], "the hung engine 0 replaced")

        engines = ray.get(stack.pool.engines.remote())
        expected = trainer_checksum(stack.trainer)
        assert [ray.get(e.weights_checksum.remote()) for e in engines] == [expected, expected]
        outs = ray.get([stack.router.generate.remote(GenerateRequest([1, 2, 3], SamplingParams())) for _ in range(6)])
        assert {o.engine_id for o in outs} == {0, 1} and {o.weight_version for o in outs} == {version}
        wait_for(all_healthy, "the new engines healthy")

        def exported():
            rows = scrape(ray_cluster.miles_ray_metrics_url)
            replaced = sum(v for _, v in rows.get("ray_miles_ray_health_replacements_total", []))
            healthy = {t["actor"]: v for t, v in rows.get("ray_miles_ray_actor_healthy", [])}
            return replaced == 3 and healthy.get("engine0") == healthy.get("engine1") == 1.0 and healthy

        wait_for(exported, "the replacements in Prometheus", 30)

        [rank] = ray.get(stack.trainer.workers.remote())
        ray.kill(rank, no_restart=True)  # reported, not replaced: the run rolls back to a checkpoint
        wait_for(lambda: not ray.get(monitor.stats.remote())["actors"]["trainer_rank0"]["healthy"], "the dead rank")
        stats = ray.get(monitor.stats.remote())
        assert stats["replaced"] == [0, 1, 0] and stats["actors"]["engine0"]["healthy"]
        wait_for(lambda: (exported() or {}).get("trainer_rank0") == 0.0, "the dead rank in Prometheus", 30)
    finally:
        ray.kill(monitor, no_restart=True)
