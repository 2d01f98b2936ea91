"""Placement: pure planners (``colocated``, ``disaggregated``, ``on_nodes``) and ``create`` to realise a plan on Ray."""

from miles_ray.lazy import lazy
from miles_ray.placement.nodes import Node, on_nodes
from miles_ray.placement.plan import PlacementPlan, Slot, colocated, disaggregated

# realising a plan needs Ray; planning does not (the trainer backends read plans without Ray installed)
__getattr__ = lazy(
    __name__,
    {
        "Placement": "miles_ray.placement.groups:Placement",
        "create": "miles_ray.placement.groups:create",
        "cluster_nodes": "miles_ray.placement.groups:cluster_nodes",
    },
)

__all__ = [
    "Node",
    "Placement",
    "PlacementPlan",
    "Slot",
    "cluster_nodes",
    "colocated",
    "create",
    "disaggregated",
    "on_nodes",
]
