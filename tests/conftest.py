import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from miles_ray.models.hub import tiny_llama_dir

    return str(tiny_llama_dir())


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the whole session; 8 logical CPUs so fractional actors fit on 2 cores."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
