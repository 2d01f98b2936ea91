"""GRPO across Ray nodes (#22), then the loss of a node, on four simulated nodes (``ray.cluster_utils.Cluster``).

The head (the driver's node, no rack) and three worker nodes: ``a1`` in rack a, two in rack b. ``placement.on_nodes``
plans on the racked nodes' inventory (``cluster_nodes``) with one spare: the trainer rank and engine 0 on rack a,
engine 1 on rack b, the other rack-b node held back. Checked where every actor really runs (Ray node ids) and
what the dashboard calls each (its repr), two
GRPO steps with verified broadcast syncs between nodes, the Router using both nodes' engines, a ``shared_memory``
broadcaster (same node: shared memory; other node: object store; both verified), a run checkpoint round-trip.
Then engine 1's node is removed with a rollout in flight: every prompt comes back exactly once, and
``heal_engines`` starts engine 1 again on the spare node with the current weights (checksum verified), and it
serves. A node is added back and the pool grows onto it (``grow_pool``). Last the trainer's node (with engine 0)
is lost: the trainer restarts on the spare from the last run checkpoint and takes the same step as the
uninterrupted run (same weights, same data position); engine 0 comes back beside it and every engine serves the
new version. Last ``Stack.shutdown`` removes every placement group the run made, the spare's one-bundle groups
included. Runs in its own process (its own Ray cluster):

    python tests/e2e/multinode_run.py MODEL_DIR CHECKPOINT_DIR     # prints one JSON line
"""

import json
import sys
import threading
import time

import ray
from helpers import ShortResponseTask, SyntheticSource, grpo_in_step, trainer_checksum
from ray.cluster_utils import Cluster
from ray.util.state import list_actors
from transformers import AutoTokenizer

from miles_ray import placement
from miles_ray.actors import WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.checkpoint import RunCheckpointer
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.fault import grow_pool, heal_engines, restart_trainer
from miles_ray.rollout import generate_groups
from miles_ray.stack import StackConfig, build_stack


def _node(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def _cluster() -> tuple[Cluster, dict]:
    # the GCS checks each node every second, not every 3 s: a removed node is declared dead after 5 missed checks,
    # ~5 s instead of ~15 s (twice per run); a live node answers a check in milliseconds even on 2 busy cores
    health = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": health})
    workers = {}
    for name, rack in (("a1", "a"), ("b1", "b"), ("b2", "b")):  # fractional CPUs: four nodes on a 2-core machine
        workers[name] = cluster.add_node(num_cpus=3, labels={"rack": rack})
    return cluster, workers


def main(model_path: str, checkpoint_dir: str) -> dict:
    cluster, workers = _cluster()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        inventory = [n for n in placement.cluster_nodes() if n.rack != "unlabelled"]  # the head runs the driver
        plan = placement.on_nodes(inventory, "disaggregated", 1, 2, spare_nodes=1, gpus=False)
        router = {"policy": "round_robin", "health_interval_s": 0.2, "max_health_failures": 1}
        config = StackConfig(
            trainer={"model_path": model_path, "optimizer": {"lr": 1e-2}},
            pool={"num_engines": 2, "engine": {"model_path": model_path, "max_seq_len": 160}},
            router=router,
        )
        stack = build_stack(config, placement.create(plan))
        out = {"racks": {n.node_id: n.rack for n in inventory}, "spare": plan.spare_nodes[0]}
        out["planned"] = {"trainer": plan.bundle_nodes[0], "engines": list(plan.bundle_nodes[1:])}
        out["driver"] = ray.get_runtime_context().get_node_id()
        out["control"] = {role: _node(a) for role, a in stack.actors().items() if role in ("pool", "router", "buffer")}
        out.update(_across_nodes(stack, model_path, checkpoint_dir))
        node_of = {w.node_id: w for w in workers.values()}
        out.update(_lose_engine_node(stack, cluster, node_of[out["nodes"]["engines"][1]], model_path))
        out.update(_grow_onto_new_node(stack, cluster))
        out.update(_lose_trainer_node(stack, cluster, node_of[out["nodes"]["trainer"]], checkpoint_dir))
        out["groups_before_shutdown"] = _live_groups()
        stack.shutdown()  # the plan's group and the one-bundle groups of the bundles moved to the spare or added
        out["groups_after_shutdown"] = _live_groups(wait_s=10.0)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def _live_groups(wait_s: float = 0.0) -> int:
    """Placement groups of the cluster not removed; waits up to ``wait_s`` for none (a removal is asynchronous)."""
    deadline = time.monotonic() + wait_s
    while True:
        live = sum(g["state"] != "REMOVED" for g in ray.util.placement_group_table().values())
        if live == 0 or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def _across_nodes(stack, model_path: str, checkpoint_dir: str) -> dict:
    [worker] = ray.get(stack.trainer.workers.remote())
    engines = list(stack.engines)
    nodes = {"trainer": _node(worker), "engines": [ray.get(e.health.remote())["node_id"] for e in engines]}
    reprs = sorted(a.repr_name for a in list_actors(filters=[("state", "=", "ALIVE")], detail=True) if a.repr_name)
    ray.get(stack.broadcaster.sync.remote(ray.get(stack.trainer.weight_version.remote())))
    checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, model_path, steps=2)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = ray.get([stack.router.generate.remote(GenerateRequest([1, 2, 3 + i], params)) for i in range(16)])
    shared = WeightBroadcaster.remote(WeightBroadcasterConfig(transport="shared_memory"), [worker], engines)
    version = ray.get(stack.trainer.weight_version.remote())
    report = ray.get(shared.sync.remote(version))
    ray.kill(shared)
    ckpt = RunCheckpointer(checkpoint_dir)
    loaded = ckpt.load(ckpt.save(3, stack.trainer), stack.trainer, restore_driver_rng=False)
    return {
        "nodes": nodes,
        "actor_reprs": reprs,
        "sync_checksums": checksums,
        "engines_used": sorted({o.engine_id for o in outs}),
        "shared_memory_sync": {k: report[k] for k in ("version", "checksum", "bytes")},
        "engine_versions": [ray.get(e.health.remote())["version"] for e in engines],
        "checkpoint_step": loaded["step"],
        "weight_version": version,
    }


def _lose_engine_node(stack, cluster: Cluster, node, model_path: str) -> dict:
    """Remove engine 1's node while a rollout is in flight on it; heal onto the spare node."""
    task = ShortResponseTask(AutoTokenizer.from_pretrained(model_path))
    params = SamplingParams(n=4, max_new_tokens=96, ignore_eos=True)
    groups: list = []
    rollout = threading.Thread(target=lambda: groups.extend(generate_groups(stack.router, task, params, 12)))
    rollout.start()
    deadline = time.time() + 60
    while ray.get(stack.router.stats.remote())["outstanding"][1] == 0:  # requests in flight on engine 1
        if time.time() > deadline:
            raise TimeoutError("no request reached engine 1")
        time.sleep(0.01)
    cluster.remove_node(node, allow_graceful=False)
    rollout.join(timeout=300)
    _wait_dead(node)
    stats = ray.get(stack.router.stats.remote())
    version = ray.get(stack.trainer.weight_version.remote())
    healed = heal_engines(stack.pool, stack.broadcaster, stack.router, version=version)
    new = ray.get(stack.pool.engines.remote())[1]
    outs = ray.get([stack.router.generate.remote(GenerateRequest([5, 6, 7 + i], SamplingParams())) for i in range(8)])
    return {
        "rollout_group_ids": sorted(g.group_id for g in groups),
        "rollout_samples": sum(g.num_samples for g in groups),
        "evicted": stats["evicted"],
        "healed": healed,
        "healed_node": ray.get(new.health.remote())["node_id"],
        "healed_checksum_matches": ray.get(new.weights_checksum.remote()) == trainer_checksum(stack.trainer),
        "engines_after_heal": sorted({o.engine_id for o in outs}),
        "versions_after_heal": sorted({o.weight_version for o in outs}),
    }


def _wait_dead(node) -> None:
    """Wait until Ray declares ``node`` dead (missed health checks, ~5 s with ``_cluster``'s settings).

    Healing before that would start an actor again on the dying node's bundle; a driver reacting to Ray's node
    events does the same.
    """
    deadline = time.time() + 120
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
        if time.time() > deadline:
            raise TimeoutError(f"Ray still reports node {node.node_id} alive")
        time.sleep(0.5)


def _grow_onto_new_node(stack, cluster: Cluster) -> dict:
    """A node joins (a repaired one coming back): the pool starts engine 2 there with the current weights."""
    node = cluster.add_node(num_cpus=3, labels={"rack": "b"})
    version = ray.get(stack.trainer.weight_version.remote())
    engine_id = grow_pool(stack.pool, stack.broadcaster, stack.router, node.node_id, version)
    engine = ray.get(stack.pool.engines.remote())[engine_id]
    outs = ray.get([stack.router.generate.remote(GenerateRequest([4, 5, 6 + i], SamplingParams())) for i in range(12)])
    return {
        "added_node": node.node_id,
        "grown_engine": engine_id,
        "grown_node": ray.get(engine.health.remote())["node_id"],
        "grown_checksum_matches": ray.get(engine.weights_checksum.remote()) == trainer_checksum(stack.trainer),
        "engines_after_grow": sorted({o.engine_id for o in outs}),
    }


def _train(trainer, source) -> None:
    ray.get(trainer.train_step.remote(source.next_batch()))


def _lose_trainer_node(stack, cluster: Cluster, node, checkpoint_dir: str) -> dict:
    """Checkpoint, take one step (the uninterrupted run), lose the trainer's node, restart, take it again."""
    source, ckpt = SyntheticSource(), RunCheckpointer(f"{checkpoint_dir}/trainer_loss")
    _train(stack.trainer, source)
    ckpt.save(1, stack.trainer, data_source=source)
    _train(stack.trainer, source)
    expected = trainer_checksum(stack.trainer), ray.get(stack.trainer.weight_version.remote()), source.position
    cluster.remove_node(node, allow_graceful=False)
    _wait_dead(node)
    restart_trainer(stack.trainer, stack.broadcaster)
    loaded = ckpt.load(None, stack.trainer, data_source=source, restore_driver_rng=False)
    _train(stack.trainer, source)
    version = ray.get(stack.trainer.weight_version.remote())
    healed = heal_engines(stack.pool, stack.broadcaster, stack.router, version=version)  # engine 0 shared the node
    ray.get(stack.broadcaster.sync.remote(version))  # broadcast from the restarted rank on the spare: verified
    [worker] = ray.get(stack.trainer.workers.remote())
    engines = ray.get(stack.pool.engines.remote())
    outs = ray.get([stack.router.generate.remote(GenerateRequest([7, 8, 9 + i], SamplingParams())) for i in range(12)])
    return {
        "resumed_step": loaded["step"],
        "resumed": [trainer_checksum(stack.trainer), version, source.position],
        "uninterrupted": list(expected),
        "restarted_trainer_node": _node(worker),
        "healed_after_trainer_loss": healed,
        "engine0_node_after": ray.get(engines[0].health.remote())["node_id"],
        "engine_checksums_match": [ray.get(e.weights_checksum.remote()) == expected[0] for e in engines],
        "engines_after_restart": sorted({o.engine_id for o in outs}),
        "versions_after_restart": sorted({o.weight_version for o in outs}),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
