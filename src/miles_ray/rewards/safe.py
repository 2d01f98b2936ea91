"""Reward functions as an extension point: a callable or an import path, resolved once, run defensively.

A reward function takes ``(response_text, entry)`` and returns a float; it may be ``async``. ``SafeReward``
runs it with a timeout and turns every failure (an exception, a timeout, a NaN/inf or non-numeric result)
into a recorded ``RewardFailure`` instead of an exception, so one bad sample never stops a run. The
rollout function gives such a sample zero weight (its loss mask is zeroed) and records why.

Usage::

    reward = SafeReward("my_pkg.rewards:exact_match", timeout_s=10)   # or SafeReward(my_fn)
    value, failure = reward("42", {"answer": "42"})                   # (1.0, None) or (0.0, RewardFailure)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles_ray.callables import resolve_callable as _resolve_callable
from miles_ray.deprecation import moved

# resolve_callable moved to miles_ray.callables (every extension point uses it, not only rewards)
__getattr__ = moved(__name__, {"resolve_callable": "miles_ray.callables:resolve_callable"})


@dataclass(frozen=True)
class RewardFailure:
    """Why a reward could not be computed."""

    kind: str  # "exception" | "timeout" | "invalid"
    message: str


class SafeReward:
    """A reward function that never raises: failures come back as ``RewardFailure``."""

    def __init__(self, fn: str | Callable[[str, Any], float], timeout_s: float = 30.0, max_workers: int = 8):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn = _resolve_callable(fn, "reward function")
        self.timeout_s = timeout_s
        # a hung call keeps its worker thread; the pool bounds how many can pile up
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def _call(self, *args: Any) -> Any:
        out = self.fn(*args)  # async functions and objects with an async __call__ return an awaitable
        return asyncio.run(_await(out)) if inspect.isawaitable(out) else out

    def _run(self, *args: Any) -> tuple[Any, RewardFailure | None]:
        """The function's raw result, or a failure if it raised or timed out."""
        future = self._pool.submit(self._call, *args)
        try:
            return future.result(timeout=self.timeout_s), None
        except concurrent.futures.TimeoutError:
            future.cancel()
            return None, RewardFailure("timeout", f"reward function took longer than {self.timeout_s}s")
        except Exception as exc:  # a user's reward function may raise anything
            return None, RewardFailure("exception", f"{type(exc).__name__}: {exc}")

    def __call__(self, text: str, entry: Any) -> tuple[float, RewardFailure | None]:
        """``(reward, None)`` on success, ``(0.0, failure)`` otherwise."""
        value, failure = self._run(text, entry)
        return (0.0, failure) if failure is not None else _checked_value(value)


async def _await(awaitable):
    return await awaitable


def _checked_value(value: Any) -> tuple[float, RewardFailure | None]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0, RewardFailure("invalid", f"reward function returned {value!r}, not a number")
    if not math.isfinite(value):
        return 0.0, RewardFailure("invalid", f"reward function returned {value}")
    return value, None


class SafeGroupReward(SafeReward):
    """A per-group reward ``(texts, entry) -> list[float]`` (one call scores all of a prompt's responses).

    For rewards that compare responses (rankings, pairwise judges, diversity bonuses). One timeout covers
    the call; if it raises, hangs or returns the wrong number of values, every sample of the group fails;
    a single NaN fails only its own sample.
    """

    def __call__(self, texts: list[str], entry: Any) -> list[tuple[float, RewardFailure | None]]:
        """One ``(reward, failure)`` per text, in order."""
        values, failure = self._run(list(texts), entry)
        if failure is None and (not isinstance(values, list | tuple) or len(values) != len(texts)):
            got = f"{len(values)} values" if isinstance(values, list | tuple) else repr(values)[:80]
            failure = RewardFailure("invalid", f"group reward function returned {got} for {len(texts)} responses")
        if failure is not None:
            return [(0.0, failure)] * len(texts)
        return [_checked_value(v) for v in values]
