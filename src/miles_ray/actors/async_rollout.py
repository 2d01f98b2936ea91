"""AsyncRollout: fully async rollout. Streams rewarded sample groups into the ReplayBuffer, non-stop.

It keeps ``prompts_in_flight`` prompts generating through the Router; each finished prompt is rewarded and its
group put in the object store and added to the buffer with the (oldest) weight version that generated it. The
trainer takes batches at its own pace (``ReplayBuffer.get_batch(..., timeout_s=...)``) and weights are pushed while
generation goes on (``WeightBroadcasterConfig.in_flight`` says what happens to requests caught mid-generation).
Off-policyness is bounded twice: it launches no new prompt while the buffer plus its in-flight prompts hold
``max_buffered_groups``, and the buffer drops groups older than ``max_staleness`` versions (keep them and correct
with ``TrainerGroupConfig(old_logprobs="rollout", mismatch_correction=...)`` instead by leaving ``max_staleness``
None).

Usage::

    rollout = AsyncRollout.remote(AsyncRolloutConfig(sampling=SamplingParams(n=8)), router, buffer, task)
    ray.get(rollout.start.remote())
    while training:
        batch = ray.get(buffer.get_batch.remote(8, current_version=version, timeout_s=600))
        ...
    ray.get(rollout.stop.remote())

(It was ``RolloutWorker`` before "worker" came to mean a rank actor only; that name still works, with a
``DeprecationWarning``.)
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import ray
from pydantic import Field

from miles_ray import metrics as mx
from miles_ray.callables import resolve_callable
from miles_ray.config import StrictConfig
from miles_ray.engines.requests import GenerateRequest, SamplingParams
from miles_ray.rewards.safe import SafeReward
from miles_ray.rollout import build_group, first_version, request_id
from miles_ray.types import GroupRef, Prompt, check_prompt


class AsyncRolloutConfig(StrictConfig):
    """Sampling, concurrency and back-pressure of the async rollout."""

    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Per prompt; n is the group size.")
    prompts_in_flight: int = Field(8, ge=1, le=1_000_000, description="Prompts generating at once.")
    max_buffered_groups: int = Field(
        32,
        ge=1,
        le=10_000_000,
        description="Launch no prompt while buffer + in-flight groups reach this many; keep it above the trainer's "
        "groups per batch, or get_batch waits for groups that are never generated.",
    )
    group_filter: str | Callable[..., Any] | None = Field(
        None, description="Keep a group only if filter(samples) is true (e.g. 'miles_ray.rollout:has_reward_signal')."
    )


@ray.remote(num_cpus=0)
class AsyncRollout:
    """Drives one data source through a Router into a ReplayBuffer, continuously (an async actor)."""

    def __init__(self, config: AsyncRolloutConfig, router, buffer, task, reward=None):
        self.config = config
        self._router = router
        self._buffer = buffer
        self._task = task
        self._reward = reward or SafeReward(task.reward)
        self._keep = resolve_callable(config.group_filter, "group_filter") if config.group_filter else None
        self._in_flight: dict[int, Prompt] = {}  # uid -> prompt
        self._pending: collections.deque[Prompt] = collections.deque()  # prompts to (re)send before new ones
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._counts = {"groups_added": 0, "samples_added": 0, "groups_dropped": 0}
        self._started_at = None
        self._stopped_at = None

    async def start(self) -> None:
        """Start generating (again, after ``stop``)."""
        if self._loop_task is not None and not self._loop_task.done():
            return
        await asyncio.gather(*self._tasks, return_exceptions=True)  # after an error, let the others land first
        self._pending.extendleft(reversed(list(self._in_flight.values())))  # prompts that failed go out again
        self._in_flight = {}
        self._error = None
        self._started_at = time.monotonic()
        self._stopped_at = None
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict:
        """Launch no more prompts and wait for the ones in flight to land in the buffer. Returns ``stats()``.

        Raises:
            The first error the rollout hit (a reward or rollout failure, no healthy engine left).

        """
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stopped_at = time.monotonic()
        if self._error is not None:
            raise self._error
        return await self.stats()

    async def stats(self) -> dict:
        """Groups and samples added, groups dropped by the filter, prompts in flight, samples/s since ``start``."""
        end = self._stopped_at or time.monotonic()
        elapsed = end - self._started_at if self._started_at is not None else 0.0
        rate = self._counts["samples_added"] / elapsed if elapsed > 0 else 0.0
        return {
            **self._counts,
            "in_flight": len(self._in_flight),
            "samples_per_s": rate,
            "running": self._loop_task is not None and not self._loop_task.done(),
            "error": None if self._error is None else repr(self._error),
        }

    async def state(self) -> dict:
        """The data position, for a run checkpoint taken while stopped (``stop()`` lands every prompt in flight).

        The source's ``state_dict()`` plus the prompts handed out but not in the buffer (ones that failed),
        which ``load_state`` sends again first: no prompt is lost or repeated.

        Raises:
            RuntimeError: while running. TypeError: if the data source has no ``state_dict()``.

        """
        if self._loop_task is not None:
            raise RuntimeError("state() while running: stop() first, so the buffer holds every finished prompt")
        if not hasattr(self._task, "state_dict"):
            raise TypeError(f"{type(self._task).__name__} has no state_dict(): its position cannot be saved")
        unsent = list(self._in_flight.values()) + list(self._pending)  # failed ones first, in uid order
        return {"task": self._task.state_dict(), "unsent": unsent, "counts": dict(self._counts)}

    async def load_state(self, state: dict) -> None:
        """Restore a ``state()`` (while stopped); the unsent prompts go out first on ``start``."""
        if self._loop_task is not None:
            raise RuntimeError("load_state while running: stop() first")
        self._task.load_state_dict(state["task"])
        self._pending = collections.deque(state["unsent"])
        self._in_flight = {}
        self._counts = dict(state["counts"])

    # --- the loop -------------------------------------------------------------------------------
    def _next_prompt(self) -> Prompt:
        return self._pending.popleft() if self._pending else check_prompt(self._task.next_prompt(), self._task)

    async def _run(self) -> None:
        c = self.config
        while self._error is None:
            if len(self._in_flight) >= c.prompts_in_flight:
                await asyncio.sleep(0.005)
                continue
            if await self._buffer.size.remote() + len(self._in_flight) >= c.max_buffered_groups:
                await asyncio.sleep(0.02)  # back-pressure: the trainer is behind
                continue
            prompt = self._next_prompt()
            self._in_flight[prompt["uid"]] = prompt
            task = asyncio.get_running_loop().create_task(self._one(prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, prompt: Prompt) -> None:
        try:
            request = GenerateRequest(prompt["prompt_ids"], self.config.sampling, request_id=request_id(prompt))
            out = await self._router.generate.remote(request)
            samples = await asyncio.to_thread(build_group, prompt, out, self._reward)
            if self._keep is None or self._keep(samples):
                await self._buffer.add.remote(
                    [GroupRef(ray.put(samples), len(samples), first_version(out), prompt["uid"])]
                )
                self._counts["groups_added"] += 1
                self._counts["samples_added"] += len(samples)
                mx.counter("rollout_samples_total", "Samples the async rollout added to the buffer").inc(len(samples))
            else:
                self._counts["groups_dropped"] += 1
            del self._in_flight[prompt["uid"]]
        except Exception as exc:  # keep the prompt as unsent; stop launching; stop()/stats() report it
            self._error = self._error or exc
