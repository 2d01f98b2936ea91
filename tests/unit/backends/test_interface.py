"""Every backend implements the primitives the RL step drives, as ``backends.interface`` declares them."""

import pytest

from miles_ray.backends.critic import TorchCriticBackend
from miles_ray.backends.interface import CriticBackend, LogprobModel, TrainBackend
from miles_ray.backends.megatron_backend import MegatronBackend
from miles_ray.backends.torch_backend import AdaptersOffReference, PolicyModel, TorchBackend
from miles_ray.contracts import protocol_gaps


@pytest.mark.parametrize(
    ("cls", "protocol"),
    [
        (TorchBackend, TrainBackend),
        (MegatronBackend, TrainBackend),
        (PolicyModel, LogprobModel),  # the frozen reference
        (AdaptersOffReference, LogprobModel),  # a LoRA policy's reference
        (TorchCriticBackend, CriticBackend),
    ],
    ids=lambda x: x.__name__,
)
def test_backend_implements_its_primitives(cls, protocol):
    assert protocol_gaps(cls, protocol) == []


def test_backends_do_not_inherit_each_other():
    """They share the data-parallel helpers (``DataParallelOps``), nothing of each other."""
    from miles_ray.backends.torch_parallel import DataParallelModel, DataParallelOps

    assert not issubclass(MegatronBackend, TorchBackend) and not issubclass(TorchBackend, MegatronBackend)
    assert MegatronBackend.__mro__[1:] == (DataParallelOps, object)
    assert not issubclass(MegatronBackend, DataParallelModel)
