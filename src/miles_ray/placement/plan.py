"""Placement planning: pure functions that decide where trainer ranks and engines go.

``colocated(n)`` puts trainer rank i and engine i into bundle i (they time-share the device: train, then
roll out); ``disaggregated(t, e)`` gives trainers and engines bundles of their own. A plan is a frozen
``PlacementPlan``; ``miles_ray.placement.groups.create`` turns it into a Ray placement group and orders
its bundles by node, then device, so rank i lands on a predictable device.

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


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}


def _check(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def colocated(
    num_ranks: int, cpus_per_bundle: float = 1.0, gpus_per_bundle: float = 0.0, strategy: str = "PACK"
) -> PlacementPlan:
    """Trainer rank i and engine i share bundle i (as Miles colocates: trainer 0.4 GPU, engine 0.2 GPU).

    Raises:
        ValueError: for a non-positive rank count or resources.

    """
    _check("num_ranks", num_ranks, 1)
    _check("cpus_per_bundle", cpus_per_bundle, 0.01)
    _check("gpus_per_bundle", gpus_per_bundle, 0.0)
    bundles = tuple(_bundle(cpus_per_bundle, gpus_per_bundle) for _ in range(num_ranks))
    trainer = tuple(Slot(i, cpus_per_bundle / 2, gpus_per_bundle * 0.4) for i in range(num_ranks))
    engine = tuple(Slot(i, cpus_per_bundle / 2, gpus_per_bundle * 0.2) for i in range(num_ranks))
    return PlacementPlan("colocated", bundles, trainer, engine, strategy)


def disaggregated(
    num_trainer_ranks: int,
    num_engines: int,
    cpus_per_bundle: float = 1.0,
    gpus_per_trainer: float = 0.0,
    gpus_per_engine: float = 0.0,
    strategy: str = "PACK",
) -> PlacementPlan:
    """Trainer ranks in bundles ``0..t-1``, engines in bundles ``t..t+e-1``, each owning its bundle.

    Raises:
        ValueError: for non-positive counts or negative resources.

    """
    _check("num_trainer_ranks", num_trainer_ranks, 1)
    _check("num_engines", num_engines, 1)
    _check("cpus_per_bundle", cpus_per_bundle, 0.01)
    _check("gpus_per_trainer", gpus_per_trainer, 0.0)
    _check("gpus_per_engine", gpus_per_engine, 0.0)
    bundles = tuple(_bundle(cpus_per_bundle, gpus_per_trainer) for _ in range(num_trainer_ranks)) + tuple(
        _bundle(cpus_per_bundle, gpus_per_engine) for _ in range(num_engines)
    )
    trainer = tuple(Slot(i, cpus_per_bundle, gpus_per_trainer) for i in range(num_trainer_ranks))
    engine = tuple(Slot(num_trainer_ranks + i, cpus_per_bundle, gpus_per_engine) for i in range(num_engines))
    return PlacementPlan("disaggregated", bundles, trainer, engine, strategy)
