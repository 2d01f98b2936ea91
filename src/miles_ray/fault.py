"""Recovering a run from lost actors: respawn dead rollout engines with current weights, restart trainer ranks.

``heal_engines`` is the engine-side recovery a driver calls between weight syncs (the Router has already
evicted a dead engine and retried its in-flight requests elsewhere, so no prompt is lost meanwhile):

1. ``RolloutPool.respawn_dead`` starts a new engine on the dead one's placement slot;
2. ``WeightBroadcaster.replace_engine`` loads the trainer's current weights into it and verifies them;
3. ``Router.add_engine`` routes to it again, under the same engine id.

``grow_pool`` starts one more engine on a chosen node (one added back after a loss) the same way.

Trainer ranks: a dead rank breaks the group's collectives, so ``restart_trainer`` rebuilds every rank from
a checkpoint (``TrainerGroup.restart``) and points the broadcaster at the new ranks; the driver rolls the
rest of the run back to the same checkpoint (``miles_ray.checkpoint.RunCheckpointer.load``).

Usage::

    healed = heal_engines(pool, broadcaster, router, version=ray.get(trainer.weight_version.remote()))
"""

from __future__ import annotations

import ray


def heal_engines(pool, broadcaster, router, version: int, health_timeout_s: float = 60.0) -> list[int]:
    """Replace every dead engine of ``pool``, give it weight ``version`` and route to it again.

    Call it between weight syncs (not during one), with the trainer's current version. An engine that does not
    answer its health check within ``health_timeout_s`` counts as dead (hung).

    Returns:
        The ids of the engines replaced.

    Raises:
        WeightSyncError: if a new engine does not hold the weights it was sent (it is not routed to then).

    """
    new = ray.get(pool.respawn_dead.remote(health_timeout_s))
    for engine_id, engine in new.items():
        ray.get(broadcaster.replace_engine.remote(engine_id, engine, version))
        ray.get(router.add_engine.remote(engine, engine_id))
    return sorted(new)


def grow_pool(pool, broadcaster, router, node_id: str, version: int) -> int:
    """Start one more engine on node ``node_id`` (a node added back to the cluster), give it weight ``version``, route.

    Call it between weight syncs, with the trainer's current version.

    Returns:
        The new engine's id.

    """
    engine_id, engine = ray.get(pool.add_engine.remote(node_id))
    ray.get(broadcaster.add_engine.remote(engine, version))
    ray.get(router.add_engine.remote(engine, engine_id))
    return engine_id


def restart_trainer(trainer, broadcaster, path: str | None = None) -> int:
    """Rebuild every trainer rank, load the trainer checkpoint at ``path``, hand the new ranks to ``broadcaster``.

    ``path`` None leaves the new ranks at the initial weights, for ``RunCheckpointer.load`` to restore the run.

    Returns:
        The restored weight version (sync the engines to it before the next rollout).

    """
    version = ray.get(trainer.restart.remote(path))
    if broadcaster is not None:
        ray.get(broadcaster.set_trainer_workers.remote(ray.get(trainer.workers.remote())))
    return version
