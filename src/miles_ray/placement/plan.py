"""Placement planning: pure functions that decide where trainer ranks and engines go.

``colocated(n)`` puts trainer rank i and engine i into bundle i (they time-share the device: train, then
roll out); ``disaggregated(t, e)`` gives trainers and engines bundles of their own. PPO's critic and a
separate reference model are roles too: ``colocated(n, critic=True, reference=True)`` adds them to the
same bundles, ``disaggregated(..., num_critic_ranks=c, num_reference_ranks=k)`` gives them their own. A plan is a frozen
``PlacementPlan``; ``miles_ray.placement.groups.create`` turns it into a Ray placement group and orders
its bundles by node, then device, so rank i lands on a predictable device. ``nodes.on_nodes`` plans on a known
inventory of nodes and racks instead (bundles pinned to nodes, model-parallel groups inside a node, spare nodes).

Usage::

    plan = colocated(num_ranks=2, cpus_per_bundle=1, gpus_per_bundle=0)
    plan.trainer_slots[0]   # Slot(bundle=0, num_cpus=0.5, num_gpus=0.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: a bundle index of the plan's placement group and its resource share."""

    bundle: int
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of one placement group and the slot of every trainer rank and engine in it."""

    mode: Literal["colocated", "disaggregated"]
    bundles: tuple[dict[str, float], ...]
    trainer_slots: tuple[Slot, ...]
    engine_slots: tuple[Slot, ...]
    strategy: str = "PACK"
    critic_slots: tuple[Slot, ...] = ()
    reference_slots: tuple[Slot, ...] = ()
    # on_nodes plans: the Ray node id each bundle is pinned to (empty: Ray chooses), and the nodes held back
    bundle_nodes: tuple[str, ...] = ()
    spare_nodes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.bundle_nodes and len(self.bundle_nodes) != len(self.bundles):
            raise ValueError(f"bundle_nodes has {len(self.bundle_nodes)} entries for {len(self.bundles)} bundles")
        if set(self.bundle_nodes) & set(self.spare_nodes):
            raise ValueError("a spare node may hold no bundle")

    def slots(self, role: Role) -> tuple[Slot, ...]:
        """The slots of one role.

        Raises:
            ValueError: for an unknown role.

        """
        if role not in ROLES:
            raise ValueError(f"unknown placement role {role!r}; roles are {ROLES}")
        return getattr(self, f"{role}_slots")


Role = Literal["trainer", "engine", "critic", "reference"]
ROLES: tuple[str, ...] = ("trainer", "engine", "critic", "reference")
# Colocated GPU shares per role (they sum to <= 1: every role fits one device; Miles uses trainer 0.4, engine 0.2)
_GPU_SHARE = {"trainer": 0.4, "engine": 0.2, "critic": 0.25, "reference": 0.15}


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def _check(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def colocated(
    num_ranks: int,
    cpus_per_bundle: float = 1.0,
    gpus_per_bundle: float = 0.0,
    strategy: str = "PACK",
    critic: bool = False,
    reference: bool = False,
) -> PlacementPlan:
    """Trainer rank i and engine i (and critic rank i, reference rank i) share bundle i.

    The bundle's CPUs are split evenly over the roles present; GPU shares are trainer 0.4, engine 0.2
    (as Miles colocates), critic 0.25, reference 0.15.

    Raises:
        ValueError: for a non-positive rank count or resources.

    """
    _check("num_ranks", num_ranks, 1)
    _check("cpus_per_bundle", cpus_per_bundle, 0.01)
    _check("gpus_per_bundle", gpus_per_bundle, 0.0)
    roles = ["trainer", "engine"] + ["critic"] * critic + ["reference"] * reference
    bundles = tuple(_bundle(cpus_per_bundle, gpus_per_bundle) for _ in range(num_ranks))
    slots = {
        role: tuple(Slot(i, cpus_per_bundle / len(roles), gpus_per_bundle * _GPU_SHARE[role]) for i in range(num_ranks))
        for role in roles
    }
    return PlacementPlan(
        "colocated",
        bundles,
        slots["trainer"],
        slots["engine"],
        strategy,
        critic_slots=slots.get("critic", ()),
        reference_slots=slots.get("reference", ()),
    )


def disaggregated(
    num_trainer_ranks: int,
    num_engines: int,
    cpus_per_bundle: float = 1.0,
    gpus_per_trainer: float = 0.0,
    gpus_per_engine: float = 0.0,
    strategy: str = "PACK",
    num_critic_ranks: int = 0,
    num_reference_ranks: int = 0,
) -> PlacementPlan:
    """Trainer ranks in bundles ``0..t-1``, engines in bundles ``t..t+e-1``, each owning its bundle.

    Critic ranks, then reference ranks, follow in bundles of their own with the trainer's resources.

    Raises:
        ValueError: for non-positive counts or negative resources.

    """
    _check("num_trainer_ranks", num_trainer_ranks, 1)
    _check("num_engines", num_engines, 1)
    _check("cpus_per_bundle", cpus_per_bundle, 0.01)
    _check("gpus_per_trainer", gpus_per_trainer, 0.0)
    _check("gpus_per_engine", gpus_per_engine, 0.0)
    _check("num_critic_ranks", num_critic_ranks, 0)
    _check("num_reference_ranks", num_reference_ranks, 0)
    counts = {"trainer": num_trainer_ranks, "engine": num_engines}
    counts.update(critic=num_critic_ranks, reference=num_reference_ranks)
    bundles, slots = [], {}
    for role, count in counts.items():
        gpus = gpus_per_engine if role == "engine" else gpus_per_trainer
        slots[role] = tuple(Slot(len(bundles) + i, cpus_per_bundle, gpus) for i in range(count))
        bundles += [_bundle(cpus_per_bundle, gpus)] * count
    return PlacementPlan(
        "disaggregated",
        tuple(bundles),
        slots["trainer"],
        slots["engine"],
        strategy,
        critic_slots=slots["critic"],
        reference_slots=slots["reference"],
    )
