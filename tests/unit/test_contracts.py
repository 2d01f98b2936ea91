"""``protocol_gaps``: a class that breaks a contract is told what is missing; the data-source contract holds."""

from miles_ray.actors.engine_actor import EngineInterface
from miles_ray.contracts import protocol_gaps
from miles_ray.data import DatasetSource
from miles_ray.rewards import ReasoningGymTask
from miles_ray.types import DataSource


def test_gaps_name_what_is_wrong():
    class Broken:
        def generate(self, request):  # sync where the contract is async
            ...

        async def health(self, verbose):  # a required parameter the contract does not pass
            ...

        async def receive_broadcast(self, plan, version):  # lost verify and in_flight
            ...

    gaps = protocol_gaps(Broken, EngineInterface)
    assert "generate: must be async" in gaps
    assert "health: extra parameter 'verbose' needs a default" in gaps
    assert "receive_broadcast: parameter 2 ('verify') missing" in gaps
    assert "load_buckets: method missing" in gaps


def test_the_bundled_data_sources_implement_the_contract():
    assert protocol_gaps(ReasoningGymTask, DataSource) == []
    assert protocol_gaps(DatasetSource, DataSource) == []

    class NoReward:
        def next_prompt(self): ...

    assert protocol_gaps(NoReward, DataSource) == ["reward: method missing"]


def test_positional_only_parameters_may_have_any_name():
    class TextReward:  # the reward is called positionally: (text, entry) is as good as (response_text, entry)
        def next_prompt(self): ...

        def reward(self, text, entry): ...

    class Renamed:
        async def generate(
            self, req
        ): ...  # generate's request is passed by name nowhere, but it is not positional-only

    assert protocol_gaps(TextReward, DataSource) == []
    assert "generate: parameter 0 must be 'request'" in protocol_gaps(Renamed, EngineInterface)
