"""What a weight sync sends: the engines' own dtype under ``engine_dtype="auto"``, float32 where that is unsure; how it
is verified."""

import pytest

from miles_ray.actors.weight_broadcaster import WeightBroadcasterConfig, sent_dtype


def test_auto_is_the_default_and_sends_what_every_engine_holds():
    assert WeightBroadcasterConfig().engine_dtype == "auto"
    assert sent_dtype("auto", ["bfloat16", "bfloat16"]) == "bfloat16"
    assert sent_dtype("auto", ["float32"]) == "float32"


@pytest.mark.parametrize("held", [["bfloat16", "float32"], ["bfloat16", None], [None]])
def test_auto_falls_back_to_float32_where_engines_differ_or_do_not_say(held):
    assert sent_dtype("auto", held) == "float32"


def test_an_explicit_dtype_wins():
    assert sent_dtype("float16", ["bfloat16"]) == "float16"


def test_verify_is_every_byte_by_default_sampled_on_request_and_nothing_else():
    assert WeightBroadcasterConfig().verify is True
    assert WeightBroadcasterConfig(verify="sampled").verify == "sampled"
    assert WeightBroadcasterConfig(verify=False).verify is False
    with pytest.raises(ValueError, match="verify"):
        WeightBroadcasterConfig(verify="some")
