"""on_nodes at the scale of a real cluster (128 nodes x 8 GPUs in 16 racks): the invariants every plan keeps."""

import math
from collections import Counter

import pytest

from miles_ray.placement import Node, PlacementPlan, on_nodes

NODES = [Node(f"n{i:03d}", rack=f"r{i // 8:02d}", devices=8) for i in range(128)]
RACK = {n.node_id: n.rack for n in NODES}


def _check_invariants(plan: PlacementPlan, group: int, spares: int) -> None:
    """Devices never oversubscribed, no bundle for two roles, trainer groups inside a node, spares idle and apart."""
    assert len(plan.bundle_nodes) == len(plan.bundles) and set(plan.bundle_nodes) <= set(RACK)
    used: Counter = Counter()
    for bundle, node in zip(plan.bundles, plan.bundle_nodes):
        used[node] += bundle["GPU"]
    assert max(used.values()) <= 8  # no device given twice
    if plan.mode == "disaggregated":  # no bundle shared by two roles
        assert not {s.bundle for s in plan.trainer_slots} & {s.bundle for s in plan.engine_slots}
    else:  # colocated: engine i on rank i's device, within the bundle's GPU
        assert all(
            t.bundle == e.bundle and t.num_gpus + e.num_gpus <= 1 for t, e in zip(plan.trainer_slots, plan.engine_slots)
        )
    trainer_nodes = [plan.bundle_nodes[s.bundle] for s in plan.trainer_slots]
    for start in range(0, len(trainer_nodes), group):  # a model-parallel group never crosses a node
        assert len(set(trainer_nodes[start : start + group])) == 1
    assert len(plan.spare_nodes) == spares and not set(plan.spare_nodes) & set(plan.bundle_nodes)
    spare_racks = {RACK[s] for s in plan.spare_nodes}
    assert len(spare_racks) == spares  # one spare per rack: a rack failure takes at most one
    for node in set(plan.bundle_nodes):  # every node's actors have a spare on another rack
        assert spare_racks - {RACK[node]}


def test_disaggregated_at_scale_packs_the_trainer_and_spreads_engines_over_racks():
    plan = on_nodes(NODES, "disaggregated", 256, 360, devices_per_engine=2, trainer_group_size=8, spare_nodes=2)
    _check_invariants(plan, group=8, spares=2)
    trainer_racks = {RACK[plan.bundle_nodes[s.bundle]] for s in plan.trainer_slots}
    assert len(trainer_racks) == math.ceil(256 / 8 / 8)  # 32 whole nodes: the fewest racks that hold them
    per_rack = Counter(RACK[plan.bundle_nodes[s.bundle]] for s in plan.engine_slots)
    assert len(per_rack) == 16 - len(trainer_racks)  # every rack with room serves
    assert max(per_rack.values()) <= math.ceil(360 / len(per_rack)) + 1  # a lost rack takes a fair share, no more
    assert all(s.num_gpus == 2 for s in plan.engine_slots)


def test_colocated_at_scale_keeps_groups_inside_nodes():
    plan = on_nodes(NODES, "colocated", 1000, trainer_group_size=8, spare_nodes=2)
    _check_invariants(plan, group=8, spares=2)
    assert len(plan.trainer_slots) == len(plan.engine_slots) == 1000 and len(set(plan.bundle_nodes)) == 125


def test_rack_order_and_node_level_placement_on_a_small_cluster():
    nodes = [Node("a1", "a", 2), Node("b1", "b", 2), Node("b2", "b", 2)]
    plan = on_nodes(nodes, "disaggregated", 1, 2, spare_nodes=1, gpus=False)
    assert plan.spare_nodes == ("b2",)  # the rack with the most nodes gives its last one
    assert plan.bundle_nodes == ("a1", "a1", "b1")  # trainer first in rack order; engines over racks a, b
    assert plan.bundles[0] == {"CPU": 1.0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_trainer_ranks": 12, "trainer_group_size": 8}, "trainer_group_size=8 must divide"),
        ({"num_trainer_ranks": 8, "num_engines": 2000}, "num_engines=2000 of devices_per_engine=1"),
        ({"num_trainer_ranks": 2000, "num_engines": 1}, "num_trainer_ranks=2000 in groups"),
        ({"num_trainer_ranks": 8, "num_engines": 4, "spare_nodes": 128}, "spare_nodes=128 leaves none"),
        ({"num_trainer_ranks": 8, "num_engines": None}, "num_engines must be >= 1"),
        ({"num_trainer_ranks": 8, "mode": "colocated", "devices_per_engine": 2}, "devices_per_engine must be 1"),
        ({"num_trainer_ranks": 8, "mode": "colocated", "num_engines": 3}, "num_engines must be None or"),
    ],
)
def test_what_cannot_fit_names_the_argument(kwargs, match):
    kwargs = {"mode": "disaggregated", **kwargs}
    with pytest.raises(ValueError, match=match):
        on_nodes(NODES, **kwargs)


def test_a_pinned_plan_refuses_a_spare_that_holds_a_bundle():
    with pytest.raises(ValueError, match="a spare node may hold no bundle"):
        PlacementPlan("colocated", ({"CPU": 1.0},), (), (), bundle_nodes=("n1",), spare_nodes=("n1",))
