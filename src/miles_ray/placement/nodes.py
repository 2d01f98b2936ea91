"""Planning on known nodes (pure): racks, model-parallel groups inside a node, spare nodes held back.

``colocated``/``disaggregated`` leave where each bundle goes to Ray. On a cluster of many nodes that is not
enough: a trainer's tensor/expert-parallel group must sit inside one node (its collectives run over NVLink, not
the network), a rack that fails should take a fraction of the engines with it rather than all of them, and a week
long job needs idle nodes to restart lost actors on. ``on_nodes`` plans all three from the cluster's inventory
(``Node``: id, rack, devices) and pins every bundle to its node; ``groups.cluster_nodes()`` reads the inventory of
a running Ray cluster, ``groups.create`` realises the plan with Ray's ``bundle_label_selector``.

The layout:

- spare nodes first: ``spare_nodes`` whole nodes are left out of the plan, on distinct racks as far as racks go,
  from the racks with the most nodes (the last racks among equals), so that every rack's actors have a spare on
  another rack when there are two spares or more (``PlacementPlan.spare_nodes``; a lost rack never takes its own
  spare with it);
- trainer ranks packed onto whole nodes in rack order (fewest racks: the data-parallel all-reduce stays close),
  each node taking a multiple of ``trainer_group_size`` consecutive ranks, so a model-parallel group never spans
  two nodes;
- engines (``devices_per_engine`` devices each, one node) spread round-robin over the racks, then over each
  rack's nodes, on the devices the trainer left;
- colocated: each device holds trainer rank i and engine i (engines of one device).

Usage::

    nodes = [Node(f"n{i}", rack=f"r{i // 8}", devices=8) for i in range(128)]
    plan = on_nodes(nodes, "disaggregated", num_trainer_ranks=512, num_engines=240, devices_per_engine=2,
                    trainer_group_size=8, spare_nodes=2)
    plan.bundle_nodes[plan.trainer_slots[0].bundle]   # the node rank 0 runs on
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from miles_ray.placement.plan import _GPU_SHARE, PlacementPlan, Slot, _check


@dataclass(frozen=True)
class Node:
    """One node of the inventory: its Ray node id, its rack (a failure domain) and how many devices it has.

    ``devices``: GPUs; on a cluster without GPUs, how many single-device actors (trainer ranks, engines of one
    device) the node hosts, each with ``cpus_per_device`` CPUs.
    """

    node_id: str
    rack: str
    devices: int


def on_nodes(
    nodes: Sequence[Node],
    mode: Literal["colocated", "disaggregated"],
    num_trainer_ranks: int,
    num_engines: int | None = None,
    devices_per_engine: int = 1,
    trainer_group_size: int = 1,
    spare_nodes: int = 0,
    cpus_per_device: float = 1.0,
    gpus: bool = True,
) -> PlacementPlan:
    """A plan whose every bundle is pinned to a node of ``nodes`` (see the module docstring for the layout).

    Args:
        nodes: the inventory (``groups.cluster_nodes()`` on a running cluster).
        mode: ``"colocated"`` (rank i and engine i share a device) or ``"disaggregated"``.
        num_trainer_ranks: trainer ranks, one device each.
        num_engines: disaggregated: engines; colocated: None or ``num_trainer_ranks``.
        devices_per_engine: devices of one engine (its tensor-parallel size), all on one node.
        trainer_group_size: consecutive trainer ranks that must share a node (TP x EP of the trainer).
        spare_nodes: whole nodes held back for replacements (``PlacementPlan.spare_nodes``).
        cpus_per_device: CPUs that go with each device.
        gpus: whether devices are GPUs (bundles then ask for ``GPU``); False on a CPU-only cluster.

    Raises:
        ValueError: naming the argument, for counts that do not fit the nodes or do not divide as they must.

    """
    _check_arguments(nodes, num_trainer_ranks, devices_per_engine, trainer_group_size, spare_nodes, cpus_per_device)
    if mode == "colocated":
        if num_engines not in (None, num_trainer_ranks):
            raise ValueError(f"colocated: num_engines must be None or num_trainer_ranks={num_trainer_ranks}")
        if devices_per_engine != 1:
            raise ValueError("colocated: devices_per_engine must be 1 (engine i shares rank i's device); "
                             "give tensor-parallel engines mode='disaggregated'")  # fmt: skip
    elif mode != "disaggregated":
        raise ValueError(f"mode must be 'colocated' or 'disaggregated', got {mode!r}")
    elif num_engines is None or num_engines < 1:
        raise ValueError(f"disaggregated: num_engines must be >= 1, got {num_engines}")
    spares = _spares(nodes, spare_nodes)
    usable = sorted((n for n in nodes if n.node_id not in spares), key=lambda n: (n.rack, n.node_id))
    free = {n.node_id: n.devices for n in usable}
    trainer_nodes = _pack_trainer(usable, free, num_trainer_ranks, trainer_group_size)
    if mode == "colocated":
        return _colocated_plan(trainer_nodes, cpus_per_device, gpus, spares)
    engine_nodes = _spread_engines(usable, free, num_engines, devices_per_engine)
    return _disaggregated_plan(trainer_nodes, engine_nodes, devices_per_engine, cpus_per_device, gpus, spares)


def _check_arguments(nodes, num_trainer_ranks, devices_per_engine, trainer_group_size, spare_nodes, cpus) -> None:
    _check("num_trainer_ranks", num_trainer_ranks, 1)
    _check("devices_per_engine", devices_per_engine, 1)
    _check("trainer_group_size", trainer_group_size, 1)
    _check("spare_nodes", spare_nodes, 0)
    _check("cpus_per_device", cpus, 0.01)
    if num_trainer_ranks % trainer_group_size:
        raise ValueError(f"trainer_group_size={trainer_group_size} must divide num_trainer_ranks={num_trainer_ranks}")
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError("nodes: a node id appears twice")
    if spare_nodes >= len(nodes):
        raise ValueError(f"spare_nodes={spare_nodes} leaves none of the {len(nodes)} nodes to run on")


def _spares(nodes: Sequence[Node], count: int) -> tuple[str, ...]:
    """``count`` node ids: each rack's last node, one rack after another (the most nodes first, then later racks)."""
    by_rack: dict[str, list[Node]] = defaultdict(list)
    for n in sorted(nodes, key=lambda n: n.node_id):
        by_rack[n.rack].append(n)
    # the fullest racks give, the last ones first: the trainer packs from the first racks and keeps them whole
    racks = sorted(by_rack, key=lambda r: (len(by_rack[r]), r), reverse=True)
    picked: list[str] = []
    while len(picked) < count:
        for rack in racks:
            if by_rack[rack] and len(picked) < count:
                picked.append(by_rack[rack].pop().node_id)
    return tuple(picked)


def _pack_trainer(usable: list[Node], free: dict[str, int], ranks: int, group: int) -> list[str]:
    """The node of each trainer rank: nodes in rack order, each taking whole groups of ``group`` ranks."""
    placed: list[str] = []
    for n in usable:
        take = min(free[n.node_id] // group * group, ranks - len(placed))
        placed += [n.node_id] * take
        free[n.node_id] -= take
    if len(placed) < ranks:
        raise ValueError(
            f"num_trainer_ranks={ranks} in groups of trainer_group_size={group} inside a node: the nodes left after "
            f"the spares hold {len(placed)}"
        )
    return placed


def _spread_engines(usable: list[Node], free: dict[str, int], engines: int, size: int) -> list[str]:
    """The node of each engine: racks in turn, each rack's nodes in turn, on devices the trainer left."""
    by_rack: dict[str, list[Node]] = defaultdict(list)
    for n in usable:
        by_rack[n.rack].append(n)
    cursor = dict.fromkeys(by_rack, 0)  # the rack's next node to try
    placed: list[str] = []
    while len(placed) < engines:
        progressed = False
        for rack, members in by_rack.items():
            for step in range(len(members)):
                n = members[(cursor[rack] + step) % len(members)]
                if free[n.node_id] >= size and len(placed) < engines:
                    placed.append(n.node_id)
                    free[n.node_id] -= size
                    cursor[rack] = (cursor[rack] + step + 1) % len(members)
                    progressed = True
                    break
        if not progressed:
            raise ValueError(
                f"num_engines={engines} of devices_per_engine={size} (one node each): only {len(placed)} fit "
                f"beside the trainer on the nodes left after the spares"
            )
    return placed


def _bundle(devices: int, cpus_per_device: float, gpus: bool) -> dict[str, float]:
    return {"CPU": cpus_per_device * devices, "GPU": float(devices)} if gpus else {"CPU": cpus_per_device * devices}


def _colocated_plan(nodes: list[str], cpus: float, gpus: bool, spares: tuple[str, ...]) -> PlacementPlan:
    gpu = 1.0 if gpus else 0.0
    trainer = tuple(Slot(i, cpus / 2, gpu * _GPU_SHARE["trainer"]) for i in range(len(nodes)))
    engine = tuple(Slot(i, cpus / 2, gpu * _GPU_SHARE["engine"]) for i in range(len(nodes)))
    bundles = tuple(_bundle(1, cpus, gpus) for _ in nodes)
    return PlacementPlan("colocated", bundles, trainer, engine, bundle_nodes=tuple(nodes), spare_nodes=spares)


def _disaggregated_plan(trainer_nodes, engine_nodes, size, cpus, gpus, spares) -> PlacementPlan:
    t = len(trainer_nodes)
    gpu = 1.0 if gpus else 0.0
    trainer = tuple(Slot(i, cpus, gpu) for i in range(t))
    engine = tuple(Slot(t + i, cpus * size, gpu * size) for i in range(len(engine_nodes)))
    bundles = tuple([_bundle(1, cpus, gpus)] * t + [_bundle(size, cpus, gpus)] * len(engine_nodes))
    return PlacementPlan(
        "disaggregated",
        bundles,
        trainer,
        engine,
        bundle_nodes=tuple(trainer_nodes + engine_nodes),
        spare_nodes=spares,
    )
