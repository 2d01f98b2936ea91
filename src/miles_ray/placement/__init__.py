"""Placement: pure planners (``colocated``, ``disaggregated``) and ``create`` to realise a plan on Ray."""

from miles_ray.lazy import lazy
from miles_ray.placement.plan import PlacementPlan, Slot, colocated, disaggregated

# realising a plan needs Ray; planning does not (the trainer backends read plans without Ray installed)
__getattr__ = lazy(
    __name__, {"Placement": "miles_ray.placement.groups:Placement", "create": "miles_ray.placement.groups:create"}
)

__all__ = ["Placement", "PlacementPlan", "Slot", "colocated", "create", "disaggregated"]
