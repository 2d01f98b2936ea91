"""Contract of the reward extension point: callables and import paths, sync and async, failures recorded."""

import asyncio
import math
import time

import pytest

from miles_ray.rewards import extract_answer
from miles_ray.rewards.safe import SafeReward


def exact(text, entry):
    return float(text.strip() == entry["answer"])


async def exact_async(text, entry):
    await asyncio.sleep(0)
    return float(text.strip() == entry["answer"])


def test_callable_and_async_and_import_path():
    assert SafeReward(exact)("42", {"answer": "42"}) == (1.0, None)
    assert SafeReward(exact_async)("41", {"answer": "42"}) == (0.0, None)
    assert SafeReward("operator:add")(2, 3) == (5.0, None)  # "module:attr"


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (lambda t, e: 1 / 0, "exception"),
        (lambda t, e: math.nan, "invalid"),
        (lambda t, e: "high", "invalid"),
        (lambda t, e: time.sleep(5), "timeout"),
    ],
)
def test_failures_are_recorded_not_raised(fn, kind):
    start = time.perf_counter()
    value, failure = SafeReward(fn, timeout_s=0.3)("x", {})
    assert value == 0.0 and failure.kind == kind
    assert time.perf_counter() - start < 3  # a hang costs the timeout, not the hang


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_xyz:f", "cannot be imported"),
        ("math:pi", "is not callable"),
        (42, "must be a callable or an import path"),
    ],
)
def test_bad_specs_fail_at_setup(spec, match):
    with pytest.raises(ValueError, match=match):
        SafeReward(spec)


def test_extract_answer():
    assert extract_answer("so <answer> 12 </answer>") == "12"
    assert extract_answer("3 + 4 = 7.") == "7"
    assert extract_answer("seven") == "seven"


def test_hung_calls_do_not_starve_the_next_ones():
    """Regression (#23): timed-out calls kept their pool threads, so once the pool was full every call timed out."""
    import threading

    release = threading.Event()

    def fn(text, entry):  # "hang" blocks until released, as a stuck sandbox or judge would
        if text == "hang":
            release.wait(60)
        return 1.0

    reward = SafeReward(fn, timeout_s=0.2, max_workers=2, max_hung=4)
    assert [reward("hang", None)[1].kind for _ in range(3)] == ["timeout"] * 3  # more than max_workers
    assert reward.hung == 3 and reward("ok", None) == (1.0, None)  # the hung ones hold no slot
    assert reward("hang", None)[1].kind == "timeout" and reward.hung == 4
    start = time.perf_counter()
    value, failure = reward("ok", None)  # max_hung reached: refused at once, not queued behind them
    assert failure.kind == "timeout" and "max_hung" in failure.message and time.perf_counter() - start < 0.1
    release.set()
    deadline = time.monotonic() + 10
    while reward.hung:
        assert time.monotonic() < deadline, "released calls never finished"
        time.sleep(0.01)
    assert reward("ok", None) == (1.0, None)
