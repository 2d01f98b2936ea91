"""``ServerProcess`` against real child processes that hang or die (stand-ins for a vLLM/SGLang server: a fault is
injected by the command itself, a socket that never answers or a process that exits)."""

import asyncio
import socket
import sys
import time

import pytest

from miles_ray.engines.requests import EngineDeadError
from miles_ray.engines.server_process import ServerDiedError, ServerError, ServerProcess

HANG = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
HANG += "conns = []\nwhile True: conns.append(s.accept())"  # accepts, never answers


class Hanging(ServerProcess):
    name = "hanging"

    def command(self) -> list[str]:
        return [sys.executable, "-c", HANG, str(self.port)]


class Exiting(ServerProcess):
    name = "exiting"

    def command(self) -> list[str]:
        return [sys.executable, "-c", "print('bye'); raise SystemExit(3)"]


def test_a_server_that_never_answers_fails_the_request_after_request_timeout_s():
    server = Hanging(startup_timeout_s=5, request_timeout_s=1.0)
    try:
        deadline = time.monotonic() + 30
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.05)

        async def call():
            t0 = time.monotonic()
            with pytest.raises(ServerError, match="request_timeout_s") as info:
                await server.post("/generate", {"text": "hi"})
            await server.aclose()
            return time.monotonic() - t0, info.value

        elapsed, exc = asyncio.run(call())
        assert elapsed < 10 and not isinstance(exc, EngineDeadError)  # slow is not dead: health checks decide
    finally:
        server.close()


def test_a_server_that_exited_raises_engine_dead_with_its_log():
    server = Exiting(startup_timeout_s=5)
    server._proc.wait(10)
    with pytest.raises(ServerDiedError, match="exited with 3") as info:
        server.check_alive()
    assert isinstance(info.value, EngineDeadError) and "bye" in str(info.value)
    with pytest.raises(EngineDeadError):
        asyncio.run(server.post("/generate", {}))
    server.close()
