"""Placement: pure planners (``colocated``, ``disaggregated``) and ``create`` to realise a plan on Ray."""

from miles_ray.placement.groups import Placement, create
from miles_ray.placement.plan import PlacementPlan, Slot, colocated, disaggregated

__all__ = ["Placement", "PlacementPlan", "Slot", "colocated", "create", "disaggregated"]
