"""Carry out a ``PlacementPlan``: create the Ray placement group and map plan bundles to real bundles.

Ray does not promise that bundle i sits on node/device i, so a probe task in each bundle reports its
node IP, node id and GPU ids, and plan bundle k is mapped, among bundles of the same shape, to the real ones in
(node IP, node id, GPU id) order, the ordering Miles uses so that trainer ranks fill devices in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_ray.placement.plan import PlacementPlan, Slot


@dataclass(frozen=True)
class Placement:
    """A ready placement group and the real bundle index for every plan bundle."""

    plan: PlacementPlan
    pg: PlacementGroup
    bundle_order: tuple[int, ...]

    def strategy(self, slot: Slot) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy that pins an actor to ``slot``'s bundle."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_order[slot.bundle]
        )

    def options(self, slot: Slot) -> dict:
        """``actor_cls.options(**placement.options(slot))`` keyword arguments."""
        return {"num_cpus": slot.num_cpus, "num_gpus": slot.num_gpus, "scheduling_strategy": self.strategy(slot)}

    def spawn(self, cls: type, role: str, count_field: str, count: int, make_args, **options) -> list:
        """Start one ``cls`` actor per ``role`` slot (``"trainer"``, ``"engine"``, ``"critic"``, ``"reference"``).

        Args:
            cls: the (undecorated) actor class.
            role: which slots of the plan to fill.
            count_field: the config field that asked for ``count`` actors, named in the error.
            count: how many actors the config asked for; must equal the plan's slot count.
            make_args: ``index -> tuple`` of constructor arguments.
            options: extra ``.options(...)`` for every actor (e.g. ``max_concurrency``).

        Raises:
            ValueError: if ``count`` differs from the number of slots (a plan without the role has none).

        """
        slots = self.plan.slots(role)
        if count != len(slots):
            hint = f" (plan it with placement.colocated(..., {role}=True) or disaggregated(...))" if not slots else ""
            raise ValueError(f"{count_field}={count} but the placement plan has {len(slots)} {role} slots{hint}")
        return [self.spawn_one(cls, role, i, make_args(i), **options) for i in range(len(slots))]

    def spawn_one(self, cls: type, role: str, index: int, args: tuple, **options):
        """Start one ``cls(*args)`` actor on the ``index``-th ``role`` slot (e.g. to replace a dead one there).

        Raises:
            IndexError: if the plan has no such slot.

        """
        slots = self.plan.slots(role)
        if not 0 <= index < len(slots):
            raise IndexError(f"{role} slot {index} does not exist (the plan has {len(slots)})")
        return ray.remote(cls).options(**self.options(slots[index]), **options).remote(*args)


@ray.remote(num_cpus=0)
def _probe() -> tuple[str, str, tuple[int, ...]]:
    context = ray.get_runtime_context()
    return ray.util.get_node_ip_address(), context.get_node_id(), tuple(int(g) for g in ray.get_gpu_ids())


def create(plan: PlacementPlan, timeout_s: float = 120.0) -> Placement:
    """Create the plan's placement group, wait until it is ready, and order its bundles.

    Raises:
        TimeoutError: if the cluster cannot fit the bundles in time (the error lists them).

    """
    pg = placement_group(list(plan.bundles), strategy=plan.strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(
            f"placement group with bundles {list(plan.bundles)} not ready after {timeout_s}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    infos = ray.get(
        [
            _probe.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                num_gpus=0.01 if plan.bundles[i].get("GPU") else 0,
            ).remote()
            for i in range(len(plan.bundles))
        ]
    )
    # bundles of one shape are interchangeable: within each shape, plan order follows (node, device)
    order = list(range(len(plan.bundles)))
    for shape in {tuple(sorted(b.items())) for b in plan.bundles}:
        members = [i for i, b in enumerate(plan.bundles) if tuple(sorted(b.items())) == shape]
        for plan_idx, real_idx in zip(members, sorted(members, key=lambda i: (*infos[i], i))):
            order[plan_idx] = real_idx
    return Placement(plan, pg, tuple(order))
