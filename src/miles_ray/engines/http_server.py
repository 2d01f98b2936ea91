"""HTTP server for one embedded engine: the subset of SGLang's native API that RL needs, plus OpenAI's API.

SGLang-native routes: ``POST /generate`` (``input_ids`` or ``text``, ``sampling_params``, ``return_logprob``,
``rid``), ``GET /health``, ``GET /health_generate``, ``POST /flush_cache``, ``POST /update_weights_from_tensor``
(safetensors bytes, base64, in ``serialized_named_tensors``), ``POST /update_weights_from_disk``,
``GET /get_weight_version``, ``POST /pause_generation`` (``mode``: ``abort`` | ``in_place``),
``POST /continue_generation``, ``POST /abort_request``, ``GET /get_model_info``.

OpenAI routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``. Besides the
standard fields, responses carry the exact token ids (vLLM's names: ``choices[i].token_ids``, and
``prompt_token_ids`` on the completion choice or the chat response), and ``/v1/completions`` accepts a
token-id prompt, so an agent using the ``openai`` client yields trainable token-in/token-out trajectories.
Streaming is not supported (a 400 says so).

Binds 127.0.0.1 by default, and any other address only with an ``api_key`` (a secret: never in reprs, and the
CLI reads it from ``MILES_RAY_ENGINE_API_KEY`` or ``--api-key-file`` so that ``ps`` does not show it); with a key
every route needs ``Authorization: Bearer <key>``. Invalid
requests get a 4xx with ``{"error": {"message", "type", "param"}}``; a failing request never stops the engine.

Usage::

    python -m miles_ray.engines.http_server --model-path DIR --port 30000
    # or, inside an asyncio program sharing an EngineLoop:
    runner, url = await start_server(loop, model_name="smollm2")
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import ipaddress
import json
import os
import time
import uuid
from pathlib import Path

from aiohttp import web
from pydantic import Field, SecretStr, ValidationError, model_validator

from miles_ray.config import StrictConfig
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.requests import EngineDeadError, GenerateOutput, GenerateRequest, SamplingParams


class HttpServerConfig(StrictConfig):
    """Where an engine's HTTP server listens."""

    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 exposes the engine to the network.")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: SecretStr | None = Field(
        None, description="Bearer token every request must carry; None disables auth (loopback hosts only)."
    )
    max_body_mb: int = Field(4096, ge=1, description="Largest body of a weight update (/update_weights_from_tensor).")
    max_request_mb: int = Field(
        32, ge=1, description="Largest body of every other route (generation, control); larger bodies get a 413."
    )

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


# request field -> SamplingParams field; unknown names are rejected, not silently ignored
_COMMON_PARAMS = {k: k for k in ("temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "ignore_eos", "seed")}
_SGLANG_PARAMS = {**_COMMON_PARAMS, "max_new_tokens": "max_new_tokens", "sampling_seed": "seed"}
_OPENAI_PARAMS = {**_COMMON_PARAMS, "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# accepted fields that are not sampling params (handled, or meaningless for one served model)
_OPENAI_IGNORED = {"model", "user", "logprobs", "top_logprobs", "return_token_ids", "stream", "tools"}
MAX_RID_CHARS = 256  # a request id is a name, not a payload


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


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


class EngineServer:
    """The routes of one engine; ``app`` is the aiohttp application."""

    def __init__(self, loop: EngineLoop, model_name: str, config: HttpServerConfig | None = None):
        self.loop = loop
        self.engine = loop.engine
        self.model_name = model_name
        self.config = config or HttpServerConfig()
        self.tokenizer = self.engine.tokenizer
        app = web.Application(middlewares=[self._middleware], client_max_size=self.config.max_body_mb * 2**20)
        get, post = web.get, web.post
        app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health_generate),
                post("/generate", self.generate),
                post("/flush_cache", self.flush_cache),
                get("/flush_cache", self.flush_cache),
                post("/update_weights_from_tensor", self.update_weights_from_tensor),
                post("/update_weights_from_disk", self.update_weights_from_disk),
                get("/get_weight_version", self.get_weight_version),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                post("/abort_request", self.abort_request),
                get("/get_model_info", self.get_model_info),
                get("/v1/models", self.models),
                post("/v1/completions", self.completions),
                post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self.app = app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        key = self.config.api_key
        if key is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {key.get_secret_value()}".encode()):
                return _error("missing or wrong bearer token in the Authorization header", 401, "authentication_error")
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(str(exc), exc.status, param=exc.param)
        except ValueError as exc:  # engine validation (prompt too long, n too large, ...)
            return _error(str(exc), 400)
        except web.HTTPException:
            raise
        except EngineDeadError as exc:  # the stepping thread is gone: nothing here will be served again
            return _error(str(exc), 503, "server_error")
        except Exception as exc:  # a bug in one request: answer 500, keep serving
            return _error(f"{type(exc).__name__}: {exc}", 500, "server_error")

    # --- SGLang-native routes ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine serves requests; 503 once its stepping thread has died (the process is useless)."""
        self.loop.check_alive()  # EngineDeadError: the middleware answers 503
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once the engine has generated one token (proves the model runs, not only the server)."""
        out = await self.loop.generate(
            GenerateRequest([self.engine.eos_token_id or 0], SamplingParams(max_new_tokens=1, temperature=0))
        )
        return web.json_response({"ok": True, "weight_version": out.weight_version})

    async def generate(self, request: web.Request) -> web.Response:
        """SGLang ``/generate``: one prompt or a batch (``input_ids`` list of lists, or ``text`` list)."""
        body = await self._json(request)
        unknown = set(body) - {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"}
        if unknown:
            raise RequestError(f"unsupported field(s) {sorted(unknown)} in /generate", param=sorted(unknown)[0])
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded engine", param="stream")
        batch, prompts = _prompts(body, self.tokenizer)
        raw = body.get("sampling_params")
        params = sampling_params({} if raw is None else raw, _SGLANG_PARAMS, "sampling_params.")
        logprob = body.get("return_logprob", False)
        if not isinstance(logprob, bool):
            raise RequestError(f"return_logprob must be true or false, got {logprob!r}", "return_logprob")
        rids = _rids(body.get("rid"), len(prompts))
        reqs = [GenerateRequest(p, params, rid) for p, rid in zip(prompts, rids)]
        outs = await self._run(reqs)
        items = [_sglang_item(out, r, c, logprob) for out, r in zip(outs, reqs) for c in out.completions]
        return web.json_response(items if batch or params.n > 1 else items[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache outlives a request in the slot cache, so there is nothing to flush."""
        return web.json_response({"success": True, "message": "no cross-request cache is kept"})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Load HF-named tensors sent as base64 safetensors bytes (``serialized_named_tensors``)."""
        from safetensors.torch import load as load_safetensors

        body = await _json(request, self.config.max_body_mb, "max_body_mb")
        blob = body.get("serialized_named_tensors")
        blobs = blob if isinstance(blob, list) else [blob]
        if not blobs or not all(isinstance(b, str) for b in blobs):
            raise RequestError("serialized_named_tensors must be base64 safetensors bytes", "serialized_named_tensors")
        try:
            named = [kv for b in blobs for kv in load_safetensors(base64.b64decode(b)).items()]
        except Exception as exc:
            msg = f"serialized_named_tensors is not valid safetensors: {exc}"
            raise RequestError(msg, "serialized_named_tensors") from None
        await self._load(named, body.get("weight_version"))
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load every ``*.safetensors`` file of ``model_path`` (an HF directory)."""
        from safetensors.torch import load_file

        body = await self._json(request)
        raw = body.get("model_path")
        if not isinstance(raw, str) or not raw:
            raise RequestError("model_path must be the path of an HF directory (a string)", "model_path")
        path = Path(raw)
        try:
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        except OSError:  # a name too long, a permission denied: not a directory we can load
            files = []
        if not files:
            raise RequestError(f"model_path {str(path)!r} is not a directory with *.safetensors files", "model_path")
        named = [kv for f in files for kv in load_file(f).items()]
        if self.engine.model.args.tie_word_embeddings:
            named = [(k, v) for k, v in named if k != "lm_head.weight"]
        await self._load(named, body.get("weight_version"))
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors from {path}"})

    async def _load(self, named: list, version) -> None:
        if version is not None and not isinstance(version, int):
            raise RequestError(f"weight_version must be an integer, got {version!r}", "weight_version")
        await asyncio.to_thread(self.engine.update_weights, named)
        if version is not None:
            self.engine.set_weight_version(version)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """The version of the loaded weights."""
        return web.json_response({"weight_version": self.engine.weight_version()})

    async def pause_generation(self, request: web.Request) -> web.Response:
        """Pause: ``abort`` (default) ends in-flight requests with their partial output; ``in_place`` keeps them."""
        body = await self._json(request, allow_empty=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place"):
            raise RequestError(f"mode must be 'abort' or 'in_place', got {mode!r}", "mode")
        await self.loop.pause(mode)
        return web.json_response({"success": True, "mode": mode})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """Resume after a pause."""
        self.loop.resume()
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        """Abort ``rid`` (or everything with ``abort_all``); the caller of that request gets its partial output."""
        body = await self._json(request)
        if body.get("abort_all"):
            self.loop.abort(None)
        elif isinstance(body.get("rid"), str):
            self.loop.abort(body["rid"])
        else:
            raise RequestError("give rid (a string) or abort_all=true", "rid")
        return web.json_response({"success": True})

    async def get_model_info(self, request: web.Request) -> web.Response:
        """Model path and the engine's limits."""
        cfg = self.engine.config
        return web.json_response(
            {
                "model_path": cfg.model_path,
                "served_model_name": self.model_name,
                "max_seq_len": cfg.max_seq_len,
                "num_slots": self.engine.num_slots,
                "dtype": cfg.dtype,
                **self.engine.stats(),
            }
        )

    # --- OpenAI routes -------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """The one served model."""
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles_ray"}
        return web.json_response({"object": "list", "data": [entry]})

    async def completions(self, request: web.Request) -> web.Response:
        """OpenAI ``/v1/completions``; ``prompt`` may be text, token ids, or a list of either."""
        body = await self._json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
        ids = [self._encode(p) for p in prompt]
        params, want_logprobs = self._openai_params(body, default_max=16, chat=False)
        outs = await self._run([GenerateRequest(p, params, f"cmpl-{uuid.uuid4().hex[:12]}") for p in ids])
        choices = []
        for p, out in zip(ids, outs):
            for c in out.completions:
                choice = {
                    "index": len(choices),
                    "text": c.text,
                    "finish_reason": _openai_reason(c.finish_reason),
                    "logprobs": None,
                    "token_ids": c.token_ids,
                    "prompt_token_ids": p,
                }
                if want_logprobs:
                    choice["logprobs"] = {
                        "tokens": self.tokenizer.convert_ids_to_tokens(c.token_ids),
                        "token_logprobs": c.logprobs,
                        "top_logprobs": None,
                        "text_offset": None,
                    }
                choices.append(choice)
        return web.json_response(self._envelope("text_completion", outs, choices, ids))

    async def chat_completions(self, request: web.Request) -> web.Response:
        """OpenAI ``/v1/chat/completions`` through the tokenizer's chat template (``tools`` passed to it)."""
        body = await self._json(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("tools must be a list of tool objects ({type, function})", "tools")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise RequestError(f"messages do not fit the model's chat template: {exc}", "messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        default_max = max(1, self.engine.config.max_seq_len - len(ids))  # OpenAI: up to the context limit
        params, want_logprobs = self._openai_params(body, default_max=default_max, chat=True)
        [out] = await self._run([GenerateRequest(ids, params, f"chatcmpl-{uuid.uuid4().hex[:12]}")])
        choices = []
        for c in out.completions:
            choice = {
                "index": len(choices),
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": _openai_reason(c.finish_reason),
                "logprobs": None,
                "token_ids": c.token_ids,
            }
            if want_logprobs:
                tokens = self.tokenizer.convert_ids_to_tokens(c.token_ids)
                choice["logprobs"] = {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, c.logprobs)
                    ]
                }
            choices.append(choice)
        resp = self._envelope("chat.completion", [out], choices, [ids])
        resp["prompt_token_ids"] = ids
        return web.json_response(resp)

    def _openai_params(self, body: dict, default_max: int, chat: bool) -> tuple[SamplingParams, bool]:
        """Sampling params and whether to return logprobs (chat: ``logprobs: true``; completions: ``logprobs: 0``)."""
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded engine", "stream")
        unknown = sorted(set(body) - set(_OPENAI_PARAMS) - _OPENAI_IGNORED - {"messages" if chat else "prompt"})
        if unknown:
            raise RequestError(f"{unknown[0]} is not supported by the embedded engine", unknown[0])
        logprobs = body.get("logprobs")
        alternatives = body.get("top_logprobs") if chat else logprobs
        if alternatives is not None and alternatives is not False and alternatives != 0:
            field = "top_logprobs" if chat else "logprobs"
            raise RequestError(f"{field} > 0 (alternative tokens) is not supported; sampled-token logprobs are", field)
        raw = {k: v for k, v in body.items() if k in _OPENAI_PARAMS and v is not None}
        if "max_tokens" not in raw and "max_completion_tokens" not in raw:
            raw["max_tokens"] = default_max
        return sampling_params(raw, _OPENAI_PARAMS, ""), logprobs is not None and logprobs is not False

    async def _json(self, request: web.Request, allow_empty: bool = False) -> dict:
        return await _json(request, self.config.max_request_mb, "max_request_mb", allow_empty)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError("each prompt must be a string or a list of token ids", "prompt")

    async def _run(self, reqs: list[GenerateRequest]) -> list[GenerateOutput]:
        """Run ``reqs`` together; all are validated first, so a bad one queues none."""
        self.loop.check_alive()  # a dead engine says so (503) whatever the request
        for r in reqs:
            self.engine.validate(r)
        return list(await asyncio.gather(*(self.loop.generate(r) for r in reqs)))

    def _envelope(self, kind: str, outs: list[GenerateOutput], choices: list, prompts: list[list[int]]) -> dict:
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
        prompt_tokens = sum(len(p) for p in prompts)
        return {
            "id": outs[0].request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "weight_version": outs[0].weight_version,
        }


def _error(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


async def _json(request: web.Request, limit_mb: int, limit_field: str, allow_empty: bool = False) -> dict:
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
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        raise RequestError("request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _rids(rid, num_prompts: int) -> list[str]:
    """One request id per prompt: a string (shared by a batch) or a list of strings; generated ones when absent."""
    if rid is None:
        return [f"gen-{uuid.uuid4().hex[:12]}" for _ in range(num_prompts)]
    rids = rid if isinstance(rid, list) else [rid] * num_prompts  # one rid for a batch: one abort ends it all
    if not all(isinstance(r, str) and 0 < len(r) <= MAX_RID_CHARS for r in rids):
        raise RequestError(f"rid must be a string of 1 to {MAX_RID_CHARS} characters, or a list of them", "rid")
    if len(rids) != num_prompts:
        raise RequestError(f"rid has {len(rids)} entries for {num_prompts} prompts", "rid")
    return rids


def _prompts(body: dict, tokenizer) -> tuple[bool, list[list[int]]]:
    """``(is_batch, prompts)`` from SGLang's ``input_ids`` or ``text``."""
    if "input_ids" in body:
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            batch, prompts = True, ids
        else:
            batch, prompts = False, [ids]
        for p in prompts:
            if not isinstance(p, list) or not all(isinstance(t, int) for t in p):
                raise RequestError("input_ids must be a list of token ids or a list of such lists", "input_ids")
        return batch, prompts
    text = body.get("text")
    if isinstance(text, str):
        return False, [tokenizer(text)["input_ids"]]
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return True, [tokenizer(t)["input_ids"] for t in text]
    raise RequestError("give input_ids (token ids) or text", "input_ids")


def _sglang_item(out: GenerateOutput, req: GenerateRequest, c, logprob: bool) -> dict:
    reason = {"type": c.finish_reason}
    if c.finish_reason == "length":
        reason["length"] = len(c.token_ids)
    elif c.finish_reason == "stop" and c.token_ids:
        reason["matched"] = c.token_ids[-1]
    meta = {
        "id": out.request_id,
        "finish_reason": reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(c.token_ids),
        "weight_version": out.weight_version,
    }
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
    return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}


def _openai_reason(reason: str) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort"}[reason]


async def start_server(
    loop: EngineLoop, model_name: str, config: HttpServerConfig | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``loop``'s engine on the running asyncio loop.

    Returns:
        ``(runner, base_url)``; ``await runner.cleanup()`` stops the server.

    """
    server = EngineServer(loop, model_name, config)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.config.host, server.config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    host = server.config.host
    if host in ("0.0.0.0", "::"):
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return runner, f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> None:
    """Run one embedded engine behind HTTP until interrupted."""
    from miles_ray.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

    p = argparse.ArgumentParser(description="miles_ray embedded engine HTTP server (SGLang-native + OpenAI API)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="visible in ps: prefer MILES_RAY_ENGINE_API_KEY or --api-key-file")
    p.add_argument("--api-key-file", default=None, help="a file holding the bearer token")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args(argv)
    key = a.api_key or os.environ.get("MILES_RAY_ENGINE_API_KEY")
    if a.api_key_file:
        key = Path(a.api_key_file).read_text().strip()
    config = HttpServerConfig(host=a.host, port=a.port, api_key=key)  # checked before the model loads
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(
            model_path=a.model_path,
            dtype=a.dtype,
            max_batch_size=a.max_batch_size,
            max_seq_len=a.max_seq_len,
            kv_cache_memory_gb=a.kv_cache_memory_gb,
            num_threads=a.num_threads,
        )
    )

    async def serve() -> None:
        runner, url = await start_server(EngineLoop(engine), a.served_model_name or Path(a.model_path).name, config)
        print(f"miles_ray engine serving {a.model_path} at {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
