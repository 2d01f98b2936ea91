"""What every route of an engine's HTTP server shares: its config, body reading, errors, sampling params, admission.

``EngineServer`` (``engines/http_server.py``, SGLang-native and control routes) and ``OpenAIRoutes``
(``engines/openai_api.py``) both build on it; neither imports the other's routes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from miles_ray.config import StrictConfig
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.requests import GenerateOutput, GenerateRequest, SamplingParams
from miles_ray.engines.tool_calls import chat_template, tool_call_parser
from miles_ray.keys import new_key

# request field -> SamplingParams field, for both APIs; unknown names are rejected, not silently ignored
SAMPLING_FIELDS = {k: k for k in ("temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "ignore_eos", "seed")}
# sampling fields of vLLM, SGLang and OpenAI that the embedded engine takes only at the value that changes nothing
# (clients send them at it by default): a penalty would sample from another distribution than the policy's, whose
# logprobs the trainer recomputes
NEUTRAL_FIELDS = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1}
JSON_IN_THREAD_BYTES = 1 << 16  # bodies past this parse on a worker thread: the event loop keeps serving meanwhile


class HttpServerConfig(StrictConfig):
    """Where an engine's HTTP server listens, who may call it, and what it accepts."""

    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 exposes the engine to the network.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: SecretStr | None = Field(
        None,
        description="Bearer token every request must carry. Not given: a random one on loopback hosts (read it "
        "from this config or RolloutPool.api_key()); a host beyond loopback needs one given.",
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="Bearer token of the admin routes (weight loads, pause/continue, aborts); when set, api_key "
        "no longer opens them, so inference clients cannot load weights. None: api_key covers every route.",
    )
    max_body_mb: int = Field(4096, ge=1, description="Largest body of a weight update (/update_weights_from_tensor).")
    max_request_mb: int = Field(
        32, ge=1, description="Largest body of every other route (generation, control); larger bodies get a 413."
    )
    max_waiting_requests: int = Field(
        1024,
        ge=1,
        description="New HTTP generation requests are refused (503, Retry-After) while this many requests (HTTP or "
        "Ray) already wait for a slot; Ray callers (the Router) are never refused.",
    )
    tool_call_parser: str = Field(
        "hermes",
        description="How /v1/chat/completions reads tool calls out of responses: 'hermes' (Qwen2.5/Qwen3 "
        "<tool_call> JSON) or the import path of a ToolCallParser class.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for /v1/chat/completions: a bundled one ('chatml_tools': ChatML with Hermes tool "
        "calls, for SmolLM2) or a Jinja file; None uses the tokenizer's own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _a_random_key_by_default(cls, data):
        # every server has a key: a loopback port is open to every user of the machine
        if isinstance(data, dict) and data.get("api_key") is None and is_loopback(str(data.get("host", "127.0.0.1"))):
            data = {**data, "api_key": new_key()}
        return data

    @field_validator("tool_call_parser")
    @classmethod
    def _parser_resolves(cls, spec: str) -> str:
        tool_call_parser(spec)  # fail where the config is made, not at the first tool call
        return spec

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, spec: str | None) -> str | None:
        chat_template(spec)
        return spec

    @model_validator(mode="after")
    def _exposed_needs_a_key(self) -> HttpServerConfig:
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"host={self.host!r} serves beyond this machine (weight loads, pauses and aborts included): "
                "set api_key, or bind 127.0.0.1"
            )
        return self


class RequestError(ValueError):
    """A client error: answered with a 4xx and this message, naming the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class OverloadedError(RuntimeError):
    """The engine's waiting queue is full: answered with a 503 and ``Retry-After``."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def error_response(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None):
    """OpenAI's error body, ``{"error": {message, type, param, code}}``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": "1"} if status == 503 and kind == "overloaded_error" else None
    return web.json_response(body, status=status, headers=headers)


async def read_json(request: web.Request, limit_mb: int, limit_field: str, allow_empty: bool = False) -> dict:
    """The body as a JSON object, read in chunks up to ``limit_mb`` (a 413 past it, before reading the rest)."""
    limit = limit_mb * 2**20
    too_large = RequestError(
        f"the request body exceeds the {limit_mb} MB limit of {request.path} (HttpServerConfig.{limit_field})",
        status=413,
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:  # chunked bodies carry no length up front
            raise too_large
        chunks.append(chunk)
    if allow_empty and size == 0:
        return {}
    raw = b"".join(chunks)
    try:
        body = await asyncio.to_thread(json.loads, raw) if size > JSON_IN_THREAD_BYTES else json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        raise RequestError("request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def flag(body: dict, key: str, default: bool, where: str = "") -> bool:
    """``body[key]`` as a bool, ``default`` when absent or null.

    Raises:
        RequestError: naming ``where + key`` when it is neither true, false nor null.

    """
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key} must be true or false, got {value!r}", f"{where}{key}")
    return value


def check_neutral(key: str, value, neutral, where: str = "") -> None:
    """Accept ``value`` of a field the engine does not implement only if it is None or ``neutral`` (no effect).

    Raises:
        RequestError: naming the field and its one accepted value.

    """
    if value is not None and (value != neutral or isinstance(value, bool) != isinstance(neutral, bool)):
        raise RequestError(
            f"{where}{key} is not supported by the embedded engine except at {neutral!r} (no effect), got {value!r}",
            param=f"{where}{key}",
        )


def sampling_params(raw: dict, names: dict[str, str], where: str) -> SamplingParams:
    """Map request fields to ``SamplingParams``.

    Raises:
        RequestError: naming an unsupported or invalid field.

    """
    if not isinstance(raw, dict):
        where = where.rstrip(".") or "sampling_params"
        raise RequestError(f"{where} must be an object of sampling fields, got {type(raw).__name__}", param=where)
    values = {}
    for key, value in raw.items():
        if key in NEUTRAL_FIELDS:
            check_neutral(key, value, NEUTRAL_FIELDS[key], where)
            continue
        if key not in names:
            raise RequestError(
                f"{where}{key} is not supported by the embedded engine; supported: {sorted(names)}",
                param=f"{where}{key}",
            )
        if value is None:
            continue
        values[names[key]] = [value] if key == "stop" and isinstance(value, str) else value
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        asked = {v: k for k, v in names.items() if k in raw}  # the name the request used (sampling_seed -> seed)
        field = asked.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else "sampling_params"
        raise RequestError(f"{where}{field}: {err['msg']}", param=f"{where}{field}") from None


class TokenizerThread:
    """Runs tokenisation and chat templates off the event loop, one call at a time.

    A long prompt then does not stall health checks and Ray calls; one at a time, as a fast tokenizer is not
    re-entrant.
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-ray-tokenize")

    async def run(self, fn, *args):
        """``fn(*args)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def admit(loop: EngineLoop, reqs: list[GenerateRequest], max_waiting: int) -> None:
    """Check ``reqs`` before any is queued: the engine is alive, the queue has room, every request is valid.

    Raises:
        EngineDeadError: the engine cannot serve (503).
        OverloadedError: ``max_waiting`` requests already wait (503, retry later).
        ValueError: naming what is wrong with a request (400); none is queued.

    """
    loop.check_alive()  # a dead engine says so (503) whatever the request
    waiting = loop.engine.stats()["waiting"]
    if waiting + len(reqs) > max_waiting:
        raise OverloadedError(
            f"{waiting} requests already wait for this engine (HttpServerConfig.max_waiting_requests={max_waiting})"
        )
    for r in reqs:
        loop.engine.validate(r)


async def run_requests(loop: EngineLoop, reqs: list[GenerateRequest], max_waiting: int) -> list[GenerateOutput]:
    """Run ``reqs`` together after ``admit``; a bad one queues none."""
    admit(loop, reqs, max_waiting)
    return list(await asyncio.gather(*(loop.generate(r) for r in reqs)))
