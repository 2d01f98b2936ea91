"""An inference server (vLLM, SGLang) as a child process of its engine actor, and an async HTTP client for it.

The base of ``VLLMServer`` and ``SGLangServer``: picks a free loopback port, starts the command a subclass
builds (``command``) with its environment (``env``), logs to a temp file whose tail goes into every error,
polls ``/health`` until the server answers, and stops the process (terminate, then kill) on ``close``.
The process is outside Ray: it inherits the actor's environment (``CUDA_VISIBLE_DEVICES`` on GPUs).

Every server gets a random ``api_key`` that the client sends as a bearer token: a loopback port is open to every
user of the node, and these servers load weights (SGLang unpickles ``/update_weights_from_tensor`` payloads,
vLLM runs ``/collective_rpc``), so an unauthenticated one lets any local user run code as the training user.
The key reaches the server through its environment or a private file (``secret_file``), never its command line.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from miles_ray.engines.requests import EngineDeadError, SamplingParams
from miles_ray.keys import new_key, write_private

_FLAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server failed to start or answered an error."""


class ServerDiedError(ServerError, EngineDeadError):
    """The server process has exited: the engine serves nothing until it is replaced."""


class ServerProcess:
    """A server child process on ``self.url``; subclasses define ``name``, ``error``, ``command`` and ``env``."""

    name = "server"
    error: type[ServerError] = ServerError

    def __init__(self, startup_timeout_s: float, request_timeout_s: float = 1800.0):
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = new_key()  # per server; `command`/`env` hand it over, the client sends it
        self._secrets = tempfile.mkdtemp(prefix=f"miles_ray_{self.name}_secrets_")  # mode 0700
        self._log = tempfile.NamedTemporaryFile(prefix=f"miles_ray_{self.name}_", suffix=".log", delete=False)
        self._session = None
        env = dict(os.environ)
        env.update(self.env())
        # own session: the server forks workers (schedulers, engine cores); close stops the whole group
        self._proc = subprocess.Popen(
            self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def command(self) -> list[str]:
        """The server's command line."""
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Variables added to the actor's environment for the server."""
        return {}

    def secret_file(self, name: str, text: str) -> str:
        """Write ``text`` to a file only this user can read (removed on ``close``); returns its path."""
        path = os.path.join(self._secrets, name)
        write_private(path, text)
        return path

    def log_tail(self, num_chars: int = 3000) -> str:
        """The end of the server's log (for error messages)."""
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-num_chars:]

    def check_alive(self) -> None:
        """Raise ``ServerDiedError`` (with the log's tail) if the server process has exited."""
        if self._proc.poll() is not None:
            raise ServerDiedError(f"{self.name} server exited with {self._proc.returncode}:\n{self.log_tail()}")

    async def _client(self):
        import aiohttp

        if self._session is None:  # no total limit (generations are long); a server silent this long is hung
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=self.request_timeout_s)
            auth = {"Authorization": f"Bearer {self.api_key}"}
            self._session = aiohttp.ClientSession(timeout=timeout, headers=auth)
        return self._session

    async def wait_healthy(self) -> None:
        """Poll ``/health`` until the server answers.

        Raises:
            ServerError: if the process exits or the timeout passes (with the log's tail).

        """
        import aiohttp

        session = await self._client()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                    if resp.status == 200:
                        return
            except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
        raise self.error(f"{self.name} server not healthy after {self.startup_timeout_s}s:\n{self.log_tail()}")

    async def request(self, method: str, route: str, json: dict | None = None, params: dict | None = None) -> dict:
        """Call the server; a non-2xx answer raises ``self.error`` (``ValueError`` for a 400).

        A server that sends nothing for ``request_timeout_s`` raises ``self.error`` (the Router's health checks decide
        whether the engine is evicted).

        A dropped connection raises ``ServerDiedError`` with the log's tail when the server has died meanwhile.
        """
        import aiohttp

        session = await self._client()
        try:
            async with session.request(method, f"{self.url}{route}", json=json, params=params) as resp:
                body = await resp.json(content_type=None) if resp.content_length != 0 else {}
        except asyncio.TimeoutError:  # aiohttp's ServerTimeoutError is both; a silent server is not a dropped one
            self.check_alive()
            msg = f"{self.name} {route} sent nothing for {self.request_timeout_s}s (request_timeout_s): it hangs"
            raise self.error(msg) from None
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(1.0)  # a crashing server takes a moment to exit
            self.check_alive()
            raise
        if resp.status == 400:
            raise ValueError(f"{self.name} rejected the request to {route}: {body}")
        if resp.status // 100 != 2:
            raise self.error(f"{self.name} {route} answered {resp.status}: {body}")
        return body if body is not None else {}

    async def post(self, route: str, json: dict | None = None, params: dict | None = None) -> dict:
        """POST to the server (see ``request``)."""
        return await self.request("POST", route, json, params)

    async def aclose(self) -> None:
        """Close the HTTP client session, then ``close``."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.close()

    def close(self) -> None:
        """Stop the server process (idempotent); a process group is killed whole (servers fork workers)."""
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # workers left behind by the parent
        shutil.rmtree(self._secrets, ignore_errors=True)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def sampling_fields(params: SamplingParams, max_tokens: str, seed: str, keep_stop: str) -> dict:
    """The sampling fields of a vLLM or SGLang request body, in the server's own names (``max_tokens``, ``seed``).

    ``keep_stop``: the server's flag that keeps a stop string in the text.

    The text is the one every engine gives (``sampling.cut_at_stop``): the tokens decoded without special
    tokens, through the stop string that ended them. Fields left unset (no stop strings, no seed) are omitted.
    """
    fields = {
        "n": params.n,
        max_tokens: params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop": params.stop or None,
        "stop_token_ids": params.stop_token_ids or None,
        "ignore_eos": params.ignore_eos,
        seed: params.seed,
        "skip_special_tokens": True,  # as the embedded engine's text: no EOS or other special token in it
        keep_stop: True,  # the stop string stays, as its tokens do (vLLM and SGLang cut it by default)
    }
    return {k: v for k, v in fields.items() if v is not None}


def server_flags(args: dict[str, str | int | float | bool]) -> list[str]:
    """Command-line flags from a passthrough mapping: ``{"mem_fraction_static": 0.5, "enable_x": True}``."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [] if value is False else [flag, str(value)]
    return flags


def check_passthrough(args: dict, own_flags: set[str], field: str, owner: str) -> None:
    """Refuse passthrough flags the engine config sets itself, and keys that are not a flag name.

    A key such as ``"host=0.0.0.0"`` would become ``--host=0.0.0.0`` and set a flag the config owns; keys are
    therefore flag names only (letters, digits, ``_`` and ``-``).

    Raises:
        ValueError: naming ``field`` and the clashing or malformed keys.

    """
    malformed = sorted(k for k in args if not _FLAG_NAME.fullmatch(k))
    if malformed:
        raise ValueError(f"{field} keys must be flag names (letters, digits, _ and -), got {malformed}")
    clash = sorted(k for k in args if k.replace("_", "-") in own_flags)
    if clash:
        raise ValueError(f"{field} may not set {clash}: {owner} sets them (use its fields)")
