"""Reward functions as an extension point: a callable or an import path, resolved once, run defensively.

A reward function takes ``(response_text, entry)`` and returns a float; it may be ``async``. ``SafeReward``
runs it with a timeout and turns every failure (an exception, a timeout, a NaN/inf or non-numeric result)
into a recorded ``RewardFailure`` instead of an exception, so one bad sample never stops a run. The
rollout function gives such a sample zero weight (its loss mask is zeroed) and records why. Python cannot stop a
thread: a call past its timeout runs on, off the count of ``max_workers`` concurrent calls, and once ``max_hung``
such calls linger new calls fail at once instead of queuing behind them.

Usage::

    reward = SafeReward("my_pkg.rewards:exact_match", timeout_s=10)   # or SafeReward(my_fn)
    value, failure = reward("42", {"answer": "42"})                   # (1.0, None) or (0.0, RewardFailure)
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
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

    def __init__(
        self,
        fn: str | Callable[[str, Any], float],
        timeout_s: float = 30.0,
        max_workers: int = 8,
        max_hung: int = 64,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_workers < 1 or max_hung < 0:
            raise ValueError(f"max_workers must be >= 1 and max_hung >= 0, got {max_workers} and {max_hung}")
        self.fn = _resolve_callable(fn, "reward function")
        self.timeout_s = timeout_s
        self.max_hung = max_hung
        # Python cannot kill a thread: a call past its timeout is left to finish on its own daemon thread and stops
        # counting against `max_workers`, so hung calls never starve the others; `max_hung` bounds how many linger
        self._slots = threading.BoundedSemaphore(max_workers)
        self._mu = threading.Lock()
        self._hung = 0

    def _call(self, *args: Any) -> Any:
        out = self.fn(*args)  # async functions and objects with an async __call__ return an awaitable
        return asyncio.run(_await(out)) if inspect.isawaitable(out) else out

    @property
    def hung(self) -> int:
        """Calls past their timeout whose thread still runs."""
        return self._hung

    def _run(self, *args: Any) -> tuple[Any, RewardFailure | None]:
        """The function's raw result, or a failure if it raised or timed out."""
        timeout = RewardFailure("timeout", f"reward function took longer than {self.timeout_s}s")
        if self._hung >= self.max_hung:
            return None, RewardFailure("timeout", f"{self._hung} earlier calls still hang (max_hung); not calling")
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):  # max_workers calls are running
            return None, timeout
        call = _Call(self._call, args)
        threading.Thread(target=call.run, args=(self._finished,), name="reward", daemon=True).start()
        if not call.done.wait(max(0.0, deadline - time.monotonic())):
            with self._mu:
                if call.abandon():  # still running: hand its slot to the next call
                    self._hung += 1
                    self._slots.release()
            return (None, timeout) if call.abandoned else call.result()
        return call.result()

    def _finished(self, call: _Call) -> None:
        """On the call's thread when it returns: free its slot, or its place among the hung calls."""
        with self._mu:
            call.returned = True
            if call.abandoned:
                self._hung -= 1
            else:
                self._slots.release()

    def __call__(self, text: str, entry: Any) -> tuple[float, RewardFailure | None]:
        """``(reward, None)`` on success, ``(0.0, failure)`` otherwise."""
        value, failure = self._run(text, entry)
        return (0.0, failure) if failure is not None else _checked_value(value)


class _Call:
    """One call of the reward function on a thread of its own, given up on (``abandon``) after the timeout."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.returned = False  # set under the owner's lock, as `abandoned` is: exactly one of them frees the slot
        self.abandoned = False
        self._value: Any = None
        self._error: BaseException | None = None

    def run(self, finished: Callable[[_Call], None]) -> None:
        try:
            self._value = self.fn(*self.args)
        except BaseException as exc:  # a user's reward function may raise anything
            self._error = exc
        finally:
            finished(self)
            self.done.set()

    def abandon(self) -> bool:
        """Give up on a call still running (the caller holds the owner's lock); False if it has just returned."""
        if self.returned:
            return False
        self.abandoned = True
        return True

    def result(self) -> tuple[Any, RewardFailure | None]:
        if self._error is not None:
            return None, RewardFailure("exception", f"{type(self._error).__name__}: {self._error}")
        return self._value, None


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
