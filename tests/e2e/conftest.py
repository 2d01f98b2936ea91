import pytest
import ray

from miles_ray import placement


@pytest.fixture
def make_placement(ray_cluster):
    """Create placements; at teardown (pass or fail) remove them, which kills every actor scheduled in them."""
    made = []

    def make(plan):
        made.append(placement.create(plan))
        return made[-1]

    yield make
    for pl in made:
        ray.util.remove_placement_group(pl.pg)
