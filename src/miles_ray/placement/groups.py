"""Carry out a ``PlacementPlan``: create the Ray placement group and map plan bundles to real bundles.

Ray does not promise that bundle i sits on node/device i, so a probe task in each bundle reports its
node IP, node id and GPU ids, and plan bundle k is mapped, among bundles of the same shape, to the real ones in
(node IP, node id, GPU id) order, the ordering Miles uses so that trainer ranks fill devices in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles_ray.placement.nodes import Node
from miles_ray.placement.plan import PlacementPlan, Slot


@dataclass(frozen=True)
class Placement:
    """A ready placement group and the real bundle index for every plan bundle.

    A plan pinned to nodes (``nodes.on_nodes``) keeps working when a node is lost: an actor started again on a
    bundle of that node goes to a spare node instead (``moved``: bundle -> a one-bundle group there; bundles of
    one lost node go to the same spare while it has room, so a model-parallel group stays inside a node).
    ``add_slot`` grows a role beyond the plan onto a node of choice (a node added to the cluster): such slots have
    bundle indices past the plan's (``added``) and move to a spare like the others.
    """

    plan: PlacementPlan
    pg: PlacementGroup
    bundle_order: tuple[int, ...]
    moved: dict[int, tuple[PlacementGroup, str]] = field(default_factory=dict, compare=False)
    added: dict[int, tuple[str, Slot, PlacementGroup, str]] = field(default_factory=dict, compare=False)

    def slots(self, role: str) -> tuple[Slot, ...]:
        """The plan's ``role`` slots, then those ``add_slot`` added."""
        return self.plan.slots(role) + tuple(slot for r, slot, _, _ in self.added.values() if r == role)

    def add_slot(self, role: str, node: str, timeout_s: float = 30.0) -> int:
        """One more ``role`` slot, on node ``node``, shaped like the role's first; returns its index among the role's.

        Raises:
            ValueError: if the plan has no ``role`` slot to copy.
            RuntimeError: if ``node`` is not alive or has no room for it within ``timeout_s``.

        """
        like = self.plan.slots(role)
        if not like:
            raise ValueError(f"the placement plan has no {role} slot to copy")
        shape = _shape(like[0])
        bundle = len(self.plan.bundles) + len(self.added)
        found = _on_node(shape, [node], self._group_name(bundle), timeout_s)
        if found is None:
            raise RuntimeError(f"node {node} cannot take one more {role} (needs {shape}); is it alive, with room?")
        self.added[bundle] = (role, Slot(bundle, like[0].num_cpus, like[0].num_gpus), found[0], node)
        return len(self.slots(role)) - 1

    def strategy(self, slot: Slot) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy that pins an actor to ``slot``'s bundle (on a spare node if its node is lost)."""
        own = self._own_group(slot.bundle)
        if own is not None:
            return PlacementGroupSchedulingStrategy(placement_group=own, placement_group_bundle_index=0)
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self.bundle_order[slot.bundle]
        )

    def node_of(self, bundle: int) -> str | None:
        """The node a pinned bundle runs on now (its spare once moved); None for a plan Ray places."""
        if bundle in self.moved:
            return self.moved[bundle][1]
        return self._home(bundle)

    def _home(self, bundle: int) -> str | None:
        """The node a bundle was first put on: the plan's pin, or the node ``add_slot`` chose."""
        if bundle in self.added:
            return self.added[bundle][3]
        return self.plan.bundle_nodes[bundle] if self.plan.bundle_nodes else None

    def _own_group(self, bundle: int) -> PlacementGroup | None:
        """The one-bundle group ``bundle`` lives in (added or moved; moved to a spare now if its node is lost)."""
        node = self.node_of(bundle)
        if node is None:
            return None
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        if node in alive:
            if bundle in self.moved:
                return self.moved[bundle][0]
            return self.added[bundle][2] if bundle in self.added else None
        lost = self._home(bundle)
        siblings = [spare for b, (_, spare) in self.moved.items() if self._home(b) == lost]
        candidates = list(dict.fromkeys(s for s in [*siblings, *self.plan.spare_nodes] if s in alive))
        shape = _shape(self.added[bundle][1]) if bundle in self.added else self.plan.bundles[bundle]
        found = _on_node(shape, candidates, self._group_name(bundle))
        if found is None:
            raise RuntimeError(
                f"node {node} of bundle {bundle} is gone and no spare node can take it (alive spares tried: "
                f"{candidates or 'none'}); plan with more spare_nodes, or add a node and create a new placement"
            )
        self.moved[bundle] = found
        return found[0]

    def _group_name(self, bundle: int) -> str:
        """The name of ``bundle``'s one-bundle group: ``remove`` finds them all by it, whoever made them."""
        return f"miles_ray:{self.pg.id.hex()}:bundle{bundle}"

    def remove(self) -> None:
        """Remove the placement group and every one-bundle group made for its moved or added bundles.

        Those are made by whichever actor moved or added the bundle (the pool, the trainer group) and, unless that
        actor is detached, live as long as the driver: so they are found by name in the cluster's table. Whatever
        runs in the groups stops.
        """
        from ray._raylet import PlacementGroupID

        prefix = self._group_name(0).removesuffix("bundle0")
        for group_id, info in ray.util.placement_group_table().items():
            if info.get("name", "").startswith(prefix) and info.get("state") != "REMOVED":
                ray.util.remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
        ray.util.remove_placement_group(self.pg)

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
        slots = self.slots(role)
        if not 0 <= index < len(slots):
            raise IndexError(f"{role} slot {index} does not exist (the plan has {len(slots)})")
        return ray.remote(cls).options(**self.options(slots[index]), **options).remote(*args)


def _on_node(shape: dict[str, float], candidates: list[str], name: str, timeout_s: float = 30.0):
    """A ready one-bundle group ``name`` of ``shape`` on the first of ``candidates`` (node ids) with room, and its node.

    None if none has room (each is tried for ``timeout_s``).
    """
    for node in candidates:
        pg = placement_group([shape], bundle_label_selector=[{NODE_ID_LABEL_KEY: node}], name=name)
        if ray.wait([pg.ready()], timeout=timeout_s)[0]:
            return pg, node
        ray.util.remove_placement_group(pg)
    return None


def _shape(slot: Slot) -> dict[str, float]:
    """The one-bundle group resources of ``slot`` (an added slot is a bundle of its own)."""
    return {"CPU": slot.num_cpus, **({"GPU": slot.num_gpus} if slot.num_gpus else {})}


def _in(pg: PlacementGroup, bundle: int = 0) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)


@ray.remote(num_cpus=0)
def _probe() -> tuple[str, str, tuple[int, ...]]:
    context = ray.get_runtime_context()
    return ray.util.get_node_ip_address(), context.get_node_id(), tuple(int(g) for g in ray.get_gpu_ids())


def create(plan: PlacementPlan, timeout_s: float = 120.0, detached: bool = False) -> Placement:
    """Create the plan's placement group, wait until it is ready, and order its bundles.

    ``detached``: the group outlives the driver that made it (for a stack built with ``StackConfig.detached``, e.g.
    from a notebook that disconnects); remove it with ``Stack.shutdown``.

    Raises:
        TimeoutError: if the cluster cannot fit the bundles in time (the error lists them).

    """
    # a pinned bundle goes to its node (every Ray node carries its id as a label), whatever the strategy says
    pins = [{NODE_ID_LABEL_KEY: node} for node in plan.bundle_nodes] or None
    lifetime = "detached" if detached else None
    pg = placement_group(list(plan.bundles), strategy=plan.strategy, bundle_label_selector=pins, lifetime=lifetime)
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
                scheduling_strategy=_in(pg, i),
                num_gpus=0.01 if plan.bundles[i].get("GPU") else 0,
            ).remote()
            for i in range(len(plan.bundles))
        ]
    )
    return Placement(plan, pg, _bundle_order(plan, infos))


def _bundle_order(plan: PlacementPlan, infos: list[tuple[str, str, tuple[int, ...]]]) -> tuple[int, ...]:
    """Plan bundle -> real bundle, for ``Placement.bundle_order``.

    Bundles of one shape (and, when pinned, one node) are interchangeable; within such a set, plan order follows
    (node IP, node id, device).
    """

    def kind(i: int) -> tuple:
        return (tuple(sorted(plan.bundles[i].items())), plan.bundle_nodes[i] if plan.bundle_nodes else None)

    order = list(range(len(plan.bundles)))
    for k in {kind(i) for i in order}:
        members = [i for i in range(len(order)) if kind(i) == k]
        for plan_idx, real_idx in zip(members, sorted(members, key=lambda i: (*infos[i], i))):
            order[plan_idx] = real_idx
    return tuple(order)


def cluster_nodes(rack_label: str = "rack", cpus_per_device: float = 1.0) -> list[Node]:
    """The running cluster's alive nodes as ``on_nodes``'s inventory.

    A node's rack is its ``rack_label`` label (``ray start --labels rack=r1``; "unlabelled" without one); its
    devices are its GPUs, or on a node without GPUs its CPUs // ``cpus_per_device``.
    """
    nodes = []
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        resources = n["Resources"]
        gpus = int(resources.get("GPU", 0))
        devices = gpus or int(resources.get("CPU", 0) // cpus_per_device)
        nodes.append(Node(n["NodeID"], n.get("Labels", {}).get(rack_label, "unlabelled"), devices))
    return nodes
