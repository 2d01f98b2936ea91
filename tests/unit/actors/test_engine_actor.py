"""The engine-actor contract: all three engine actors implement it in full; the one in-flight/pause validation."""

import pytest

from miles_ray.actors.embedded_engine import EmbeddedEngineActor
from miles_ray.actors.engine_actor import IN_FLIGHT_MODES, EngineControl, EngineInterface, check_in_flight
from miles_ray.actors.sglang_engine import SGLangEngineActor
from miles_ray.actors.vllm_engine import VLLMEngineActor
from miles_ray.contracts import protocol_gaps, protocol_members
from miles_ray.engines.requests import check_pause_mode

ACTORS = [EmbeddedEngineActor, VLLMEngineActor, SGLangEngineActor]


@pytest.mark.parametrize("cls", ACTORS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [EngineInterface, EngineControl], ids=lambda p: p.__name__)
def test_every_engine_actor_implements_the_contract(cls, protocol):
    assert protocol_gaps(cls, protocol) == []


def test_the_interface_lists_exactly_what_the_stack_calls():
    """Router: generate, health; RolloutPool: health, release/resume_memory; WeightBroadcaster: the sync methods."""
    assert set(protocol_members(EngineInterface)) == {
        "generate",
        "health",
        "release_memory",
        "resume_memory",
        "takes_adapters",
        "takes_full_weights",
        "weights_dtype",
        "checksum_kind",
        "takes_sampled_verify",
        "sync_ranks",
        "join_sync_group",
        "receive_broadcast",
        "load_buckets",
    }


def test_one_validation_for_in_flight_and_pause_modes():
    for mode in IN_FLIGHT_MODES:
        check_in_flight(mode)
    with pytest.raises(ValueError, match=r"in_flight must be one of \('continue', 'finish', 'abort_resume'\)"):
        check_in_flight("drop")
    with pytest.raises(ValueError, match=r"vllm engines support in_flight in \('continue',\) only, got 'finish'"):
        check_in_flight("finish", VLLMEngineActor.in_flight_modes, VLLMEngineActor.kind)
    assert SGLangEngineActor.in_flight_modes == ("continue",) and EmbeddedEngineActor.in_flight_modes == IN_FLIGHT_MODES
    with pytest.raises(ValueError, match="pause mode must be one of"):
        check_pause_mode("later")
