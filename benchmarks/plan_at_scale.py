"""Placement planning at cluster scale (#22): ``on_nodes`` for 128 nodes x 8 GPUs in 16 racks, 2 spare nodes.

Pure computation (no Ray): the plan a 1024-GPU job realises, colocated and disaggregated, with trainer groups of
8 inside a node and 2-GPU engines spread over racks. Prints seconds per plan (best of 5) and the plan's shape.

    python benchmarks/plan_at_scale.py
"""

from __future__ import annotations

import time

from common import emit

from miles_ray.placement import Node, on_nodes

NODES = [Node(f"n{i:03d}", rack=f"r{i // 8:02d}", devices=8) for i in range(128)]
CASES = {
    "colocated, 1000 ranks, groups of 8": dict(mode="colocated", num_trainer_ranks=1000, trainer_group_size=8),
    "disaggregated, 256 ranks + 360 TP-2 engines": dict(
        mode="disaggregated", num_trainer_ranks=256, num_engines=360, devices_per_engine=2, trainer_group_size=8
    ),
    "disaggregated, 512 ranks + 240 TP-2 engines": dict(
        mode="disaggregated", num_trainer_ranks=512, num_engines=240, devices_per_engine=2, trainer_group_size=8
    ),
}


def main() -> None:
    rows = []
    for name, kwargs in CASES.items():
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            plan = on_nodes(NODES, spare_nodes=2, **kwargs)
            seconds.append(time.perf_counter() - start)
        rows.append(
            {
                "plan": name,
                "seconds": min(seconds),
                "bundles": len(plan.bundles),
                "nodes_used": len(set(plan.bundle_nodes)),
                "spares": " ".join(plan.spare_nodes),
            }
        )
    emit("plan_at_scale", rows)


if __name__ == "__main__":
    main()
