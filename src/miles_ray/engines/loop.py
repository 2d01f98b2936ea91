"""``EngineLoop``: steps an embedded engine on a worker thread and gives asyncio callers awaitable requests.

The engine actor and the HTTP server share one loop per engine, so Ray calls and HTTP requests join the
same running batch. A request whose awaiting task is cancelled (a client that went away, a cancelled
Ray task) is aborted, so it stops taking a slot. A step that raises outside the engine's own per-request
isolation fails the requests in the engine and the loop goes on; ``alive`` says whether the thread still runs
(``health`` reports it), and a dead loop answers every request with ``EngineDeadError`` instead of hanging.

Usage::

    loop = EngineLoop(EmbeddedEngine(config))
    out = await loop.generate(GenerateRequest(prompt_ids=ids))
    async with contextlib.aclosing(loop.stream(request)) as events:   # tokens as they are sampled
        async for event in events:                                    # TokenEvent..., then the GenerateOutput
            ...
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from miles_ray.engines.embedded import EmbeddedEngine
from miles_ray.engines.requests import EngineDeadError, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of sample ``index`` of a streamed request."""

    index: int
    token_id: int
    logprob: float


class EngineLoop:
    """Runs ``engine.step()`` whenever the engine has work; idle otherwise."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine
        self._wake = threading.Event()
        self._ids = itertools.count()
        self.step_errors = 0  # steps that raised past the engine's per-request isolation
        self._thread = threading.Thread(target=self._run, name="miles-ray-engine-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                if self.engine.has_work():
                    self.engine.step()
                else:
                    self._wake.wait()
                    self._wake.clear()
            except Exception as exc:  # a bug no request can be blamed for: fail them all, keep serving
                self.step_errors += 1
                log.exception("engine step failed; failing the requests in the engine")
                self.engine.fail_all(exc)

    @property
    def alive(self) -> bool:
        """Whether the stepping thread runs (requests are served)."""
        return self._thread.is_alive()

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if the stepping thread has died."""
        if not self.alive:
            raise EngineDeadError("the embedded engine's stepping thread has died; no request can be served")

    def wake(self) -> None:
        """Make the worker look for work now (after a submit, abort or resume)."""
        self._wake.set()

    def _admit(self, request: GenerateRequest) -> None:
        """Refuse work on a dead loop; name a request without ``request_id`` (``abort`` addresses requests by it)."""
        self.check_alive()
        if not request.request_id:
            request.request_id = f"req-{next(self._ids)}"

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Submit ``request`` and wait for its output; a request without ``request_id`` gets a unique one.

        Raises:
            ValueError: for an invalid request (nothing is queued).
            EngineDeadError: if the stepping thread has died.

        """
        self._admit(request)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(out: GenerateOutput) -> None:
            loop.call_soon_threadsafe(_resolve, fut, out, None)

        def failed(exc: BaseException) -> None:
            loop.call_soon_threadsafe(_resolve, fut, None, exc)

        self.engine.submit(request, done, failed)
        self.wake()
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    async def stream(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """Submit ``request`` and yield a ``TokenEvent`` per sampled token, then its ``GenerateOutput``.

        Closing the iterator early (a client that went away) aborts the request.

        Raises:
            ValueError: for an invalid request (nothing is queued).
            EngineDeadError: if the stepping thread has died.

        """
        self._admit(request)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # engine thread -> this event loop, in order
            loop.call_soon_threadsafe(events.put_nowait, item)

        self.engine.submit(request, put, put, lambda i, tok, lp: put(TokenEvent(i, tok, lp)))
        self.wake()
        finished = False
        try:
            while not finished:
                item = await events.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = isinstance(item, GenerateOutput)
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str | None = None) -> None:
        """Abort one request (or all); its output so far is returned to its caller."""
        self.engine.abort(request_id)
        self.wake()

    async def pause(self, mode: str = "abort") -> None:
        """Pause the engine (see ``EmbeddedEngine.pause``); returns once no step is running."""
        await asyncio.to_thread(self.engine.pause, mode)

    def resume(self) -> None:
        """Continue after ``pause``."""
        self.engine.resume()
        self.wake()


def _resolve(fut: asyncio.Future, out: GenerateOutput | None, exc: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(out)
