"""ServerEngineActor: what the vLLM and SGLang engine actors share, an engine that is a server child process.

The actor owns one ``ServerProcess`` (``self.server``), waits for its health on first use, tracks outstanding
requests for the Router, and records the weight version and checksum of the last load. Subclasses add the
engine's own pause/abort/cache routes and weight loading. Both support ``in_flight="continue"`` only: a weight load
pauses the server in place and running requests go on with the new weights.
"""

from __future__ import annotations

import asyncio

import ray

from miles_ray.actors.engine_actor import EngineActorBase
from miles_ray.engines.requests import GenerateOutput, GenerateRequest, PauseMode, check_pause_mode
from miles_ray.engines.server_process import ServerProcess


class ServerEngineActor(EngineActorBase):
    """Base of engine actors whose engine is a server process (apply ``ray.remote`` via ``RolloutPool``).

    Subclasses implement ``_pause`` and ``_resume_server`` with the server's routes.
    """

    kind = "server"
    in_flight_modes = ("continue",)  # the servers' abort/retract pauses are not mapped onto finish/abort_resume

    def __init__(self, engine_id: int, config, server: ServerProcess):
        self.engine_id = engine_id
        self.config = config
        self.server = server
        self.url = server.url
        self._version = 0
        self._checksum = None
        self._outstanding = 0
        self._inflight: dict[str, asyncio.Task] = {}
        self._ready = None
        self._user_paused = False  # by pause(), until resume(): a weight load leaves the server paused then

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Pause generation (see ``EngineActorBase.pause``); it lasts until ``resume``, across weight loads."""
        check_pause_mode(mode)
        self._user_paused = True  # before the route: a load ending meanwhile must not continue the server
        await self._pause(mode)

    async def resume(self) -> None:
        """Continue after ``pause``."""
        self._user_paused = False
        await self._resume_server()

    async def _resume_server(self) -> None:
        """Have the server continue (``resume``; a weight load's end unless the user paused it)."""
        raise NotImplementedError

    async def _started(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self.server.wait_healthy())
        await self._ready

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample ``request`` on the server (the server batches concurrent requests itself).

        Raises:
            ValueError: for a request the server rejects (e.g. longer than its context length).

        """
        await self._started()
        first, self._outstanding = self._version, self._outstanding + 1
        task = asyncio.ensure_future(self.server.generate(request, **self._request_options()))
        self._inflight[request.request_id] = task
        try:
            completions = await task
        except asyncio.CancelledError:
            completions = []  # cancelled here: the server drops the request when the connection closes
        finally:
            self._outstanding -= 1
            self._inflight.pop(request.request_id, None)
        return GenerateOutput(request.request_id, completions, self._version, self.engine_id, first)

    def _request_options(self) -> dict:
        """Per-request server options fixed when the request starts (the SGLang engine's LoRA adapter)."""
        return {}

    async def health(self) -> dict:
        """Liveness (waits for the server on the first call) plus load and the loaded weight version."""
        await self._started()
        self.server.check_alive()
        return {
            "engine_id": self.engine_id,
            "outstanding": self._outstanding,
            "version": self._version,
            "url": self.url,
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "kind": self.kind,
        }

    async def shutdown(self) -> None:
        """Stop the server process."""
        await self.server.aclose()

    def __del__(self):
        if (server := getattr(self, "server", None)) is not None:  # Ray's actor-class wrapper has none
            server.close()

    async def weight_version(self) -> int:
        """Version of the loaded weights."""
        return self._version

    async def weights_dtype(self) -> str | None:
        """The configured weights dtype; None for ``auto`` (the server picks it from the model config)."""
        return None if self.config.dtype == "auto" else self.config.dtype

    async def weights_checksum(self) -> str | None:
        """Checksum of the weights after the last load (None before the first sync or without verify)."""
        return self._checksum
