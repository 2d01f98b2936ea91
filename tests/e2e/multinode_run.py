"""GRPO across Ray nodes (#22), on a cluster of three simulated nodes on this machine (``ray.cluster_utils.Cluster``).

A disaggregated plan spread one bundle per node (``STRICT_SPREAD``): the trainer rank on one node, an engine on
each of the two others. Checked where every actor really runs (Ray node ids), two GRPO steps with verified
broadcast syncs between nodes, the Router spreading requests over both nodes' engines, a ``shared_memory``
broadcaster falling back to object-store copies for engines on other nodes (and verifying), and a run checkpoint
written and read back across nodes. Runs in its own process (its own Ray cluster):

    python tests/e2e/multinode_run.py MODEL_DIR CHECKPOINT_DIR     # prints one JSON line
"""

import json
import sys

import ray
from helpers import grpo_in_step
from ray.cluster_utils import Cluster

from miles_ray import placement
from miles_ray.actors import WeightBroadcaster, WeightBroadcasterConfig
from miles_ray.checkpoint import RunCheckpointer
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.stack import StackConfig, build_stack


def _node(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def main(model_path: str, checkpoint_dir: str) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for rack in ("a", "b"):  # fractional CPUs: three nodes' worth of actors on a 2-core machine
        cluster.add_node(num_cpus=2, labels={"rack": rack})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        pl = placement.create(placement.disaggregated(1, 2, cpus_per_bundle=1, strategy="STRICT_SPREAD"))
        config = StackConfig(
            trainer={"model_path": model_path, "optimizer": {"lr": 1e-2}},
            pool={"num_engines": 2, "engine": {"model_path": model_path, "max_seq_len": 128}},
        )
        stack = build_stack(config, pl)
        [worker] = ray.get(stack.trainer.workers.remote())
        engines = list(stack.engines)
        nodes = {"trainer": _node(worker), "engines": [ray.get(e.health.remote())["node_id"] for e in engines]}
        ray.get(stack.broadcaster.sync.remote(ray.get(stack.trainer.weight_version.remote())))
        checksums = grpo_in_step(stack.trainer, stack.router, stack.broadcaster, model_path, steps=2)
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        outs = ray.get([stack.router.generate.remote(GenerateRequest([1, 2, 3 + i], params)) for i in range(16)])
        shared = WeightBroadcaster.remote(WeightBroadcasterConfig(transport="shared_memory"), [worker], engines)
        version = ray.get(stack.trainer.weight_version.remote())
        report = ray.get(shared.sync.remote(version))
        ckpt = RunCheckpointer(checkpoint_dir)
        saved = ckpt.save(3, stack.trainer)
        loaded = ckpt.load(saved, stack.trainer, restore_driver_rng=False)
        return {
            "nodes": nodes,
            "alive_nodes": len([n for n in ray.nodes() if n["Alive"]]),
            "sync_checksums": checksums,
            "engines_used": sorted({o.engine_id for o in outs}),
            "shared_memory_sync": {k: report[k] for k in ("version", "checksum", "bytes")},
            "engine_versions": [ray.get(e.health.remote())["version"] for e in engines],
            "checkpoint_step": loaded["step"],
            "weight_version": version,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
