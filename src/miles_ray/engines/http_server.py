"""HTTP server for one embedded engine: the subset of SGLang's native API that RL needs, plus OpenAI's API.

SGLang-native routes: ``POST /generate`` (``input_ids`` or ``text``, ``sampling_params``, ``return_logprob``,
``rid``), ``GET /health``, ``GET /health_generate``, ``POST /flush_cache``, ``POST /update_weights_from_tensor``
(safetensors bytes, base64, in ``serialized_named_tensors``), ``POST /update_weights_from_disk``,
``GET /get_weight_version``, ``POST /pause_generation`` (``mode``: ``abort`` | ``in_place``),
``POST /continue_generation``, ``POST /abort_request``, ``GET /get_model_info``.

OpenAI routes (``engines/openai_api.py``): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, streamed or not, with tool calls, and the exact token ids for the trainer.

Binds 127.0.0.1 by default, and any other address only with an ``api_key`` given. Every route needs
``Authorization: Bearer <key>``: a server without a given key gets a random one (a loopback port is open to every
user of the machine). Keys are secrets: never in reprs, and the CLI reads them from ``MILES_RAY_ENGINE_API_KEY`` or
``--api-key-file`` (writing a random one there) so that ``ps`` does not show them. With an ``admin_api_key`` the
admin routes (weight loads, pause/continue, aborts) need that one instead. Invalid requests get a 4xx with
``{"error": {"message", "type", "param"}}``; a failing request never stops the engine; a client that disconnects
cancels its request (the engine aborts it); past ``max_waiting_requests`` waiting, new ones get a 503.

Usage::

    python -m miles_ray.engines.http_server --model-path DIR --port 30000
    # or, inside an asyncio program sharing an EngineLoop:
    runner, url = await start_server(loop, model_name="smollm2")
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import uuid
from pathlib import Path

from aiohttp import web

from miles_ray.engines.http_common import (
    SAMPLING_FIELDS,
    HttpServerConfig,
    OverloadedError,
    RequestError,
    TokenizerThread,
    check_neutral,
    error_response,
    flag,
    is_loopback,
    read_json,
    run_requests,
    sampling_params,
)
from miles_ray.engines.loop import EngineLoop
from miles_ray.engines.openai_api import OpenAIRoutes
from miles_ray.engines.requests import EngineDeadError, GenerateOutput, GenerateRequest, SamplingParams
from miles_ray.engines.sampling import cut_at_stop
from miles_ray.keys import bearer_matches, cli_key

__all__ = ["EngineServer", "HttpServerConfig", "RequestError", "is_loopback", "main", "start_server"]

_SGLANG_PARAMS = {**SAMPLING_FIELDS, "max_new_tokens": "max_new_tokens", "sampling_seed": "seed"}
# SGLang's decoding flags of sampling_params, taken at SGLang's defaults only (the text leaves special tokens out)
_DECODING_DEFAULTS = {"skip_special_tokens": True, "spaces_between_special_tokens": True}
# routes that change what the engine serves: with HttpServerConfig.admin_api_key only that key opens them
ADMIN_ROUTES = frozenset(
    {
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
    }
)
MAX_RID_CHARS = 256  # a request id is a name, not a payload


class EngineServer:
    """The routes of one engine; ``app`` is the aiohttp application."""

    def __init__(self, loop: EngineLoop, model_name: str, config: HttpServerConfig | None = None):
        self.loop = loop
        self.engine = loop.engine
        self.model_name = model_name
        self.config = config or HttpServerConfig()
        self.tokenizer = self.engine.tokenizer
        self.tokenize = TokenizerThread()
        openai = OpenAIRoutes(loop, model_name, self.config, self.tokenize)
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
                *openai.routes(),
            ]
        )
        self.app = app

    def _required_key(self, path: str) -> tuple[str | None, str]:
        """The key ``path`` needs (None: no auth) and its name in the 401 message."""
        if self.config.admin_api_key is not None and path in ADMIN_ROUTES:
            return self.config.admin_api_key.get_secret_value(), "admin bearer token"
        key = self.config.api_key
        return (key.get_secret_value() if key is not None else None), "bearer token"

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        key, what = self._required_key(request.path)
        if key is not None and not bearer_matches(request.headers.get("Authorization", ""), key):
            return error_response(f"missing or wrong {what} in the Authorization header", 401, "authentication_error")
        try:
            return await handler(request)
        except RequestError as exc:
            return error_response(str(exc), exc.status, param=exc.param)
        except ValueError as exc:  # engine validation (prompt too long, n too large, ...)
            return error_response(str(exc), 400)
        except web.HTTPException:
            raise
        except EngineDeadError as exc:  # the stepping thread is gone: nothing here will be served again
            return error_response(str(exc), 503, "server_error")
        except OverloadedError as exc:  # the queue is full: retry later (Retry-After)
            return error_response(str(exc), 503, "overloaded_error")
        except Exception as exc:  # a bug in one request: answer 500, keep serving
            return error_response(f"{type(exc).__name__}: {exc}", 500, "server_error")

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
        batch, prompts = await self.tokenize.run(_prompts, body, self.tokenizer)
        raw, keep_stop = _output_flags(body.get("sampling_params"))
        params = sampling_params(raw, _SGLANG_PARAMS, "sampling_params.")
        logprob = body.get("return_logprob", False)
        if not isinstance(logprob, bool):
            raise RequestError(f"return_logprob must be true or false, got {logprob!r}", "return_logprob")
        rids = _rids(body.get("rid"), len(prompts))
        reqs = [GenerateRequest(p, params, rid) for p, rid in zip(prompts, rids)]
        outs = await run_requests(self.loop, reqs, self.config.max_waiting_requests)
        items = await self.tokenize.run(_sglang_items, outs, reqs, logprob, keep_stop, self.tokenizer)
        return web.json_response(items if batch or params.n > 1 else items[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache outlives a request in the slot cache, so there is nothing to flush."""
        return web.json_response({"success": True, "message": "no cross-request cache is kept"})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """Load HF-named tensors sent as base64 safetensors bytes (``serialized_named_tensors``)."""
        body = await read_json(request, self.config.max_body_mb, "max_body_mb")
        blob = body.get("serialized_named_tensors")
        blobs = blob if isinstance(blob, list) else [blob]
        if not blobs or not all(isinstance(b, str) for b in blobs):
            raise RequestError("serialized_named_tensors must be base64 safetensors bytes", "serialized_named_tensors")
        try:  # gigabytes to decode: on a worker thread, so health checks and generation go on meanwhile
            named = await asyncio.to_thread(_decode_tensors, blobs)
        except Exception as exc:
            msg = f"serialized_named_tensors is not valid safetensors: {exc}"
            raise RequestError(msg, "serialized_named_tensors") from None
        await self._load(named, body.get("weight_version"))
        return web.json_response({"success": True, "message": f"loaded {len(named)} tensors"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load every ``*.safetensors`` file of ``model_path`` (an HF directory)."""
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
        named = await asyncio.to_thread(_read_tensors, files)
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

    async def _json(self, request: web.Request, allow_empty: bool = False) -> dict:
        return await read_json(request, self.config.max_request_mb, "max_request_mb", allow_empty)


def _decode_tensors(blobs: list[str]) -> list:
    from safetensors.torch import load

    return [kv for b in blobs for kv in load(base64.b64decode(b)).items()]


def _read_tensors(files: list[Path]) -> list:
    from safetensors.torch import load_file

    return [kv for f in files for kv in load_file(f).items()]


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


def _output_flags(raw) -> tuple[dict, bool]:
    """``sampling_params`` less SGLang's output flags, and ``no_stop_trim`` (False by default, as SGLang's).

    Raises:
        RequestError: naming a flag with another value than SGLang's default, or a ``no_stop_trim`` not a bool.

    """
    if not isinstance(raw, dict):
        return {} if raw is None else raw, False  # sampling_params() names what is wrong with it
    keep = flag(raw, "no_stop_trim", False, "sampling_params.")
    raw = {k: v for k, v in raw.items() if k != "no_stop_trim"}
    for key, default in _DECODING_DEFAULTS.items():
        check_neutral(key, raw.pop(key, None), default, "sampling_params.")
    return raw, keep


def _sglang_items(outs: list[GenerateOutput], reqs: list[GenerateRequest], logprob: bool, keep_stop: bool, tokenizer):
    """The items of ``/generate``'s answer.

    As SGLang's, unless ``keep_stop`` (``no_stop_trim``), a text leaves out the stop string that ended it, or the
    text of a matched stop token (a special token, EOS, has none).
    """
    items, special = [], set(tokenizer.all_special_ids)
    for out, req in zip(outs, reqs):
        for c in out.completions:
            text = c.text
            if not keep_stop and isinstance(c.stop_reason, str):
                text = cut_at_stop(text, c.stop_reason, keep=False)
            elif not keep_stop and isinstance(c.stop_reason, int) and c.stop_reason not in special:
                text = tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
            items.append(_sglang_item(out, req, c, logprob, text))
    return items


def _sglang_item(out: GenerateOutput, req: GenerateRequest, c, logprob: bool, text: str) -> dict:
    reason = {"type": c.finish_reason}
    if c.finish_reason == "length":
        reason["length"] = len(c.token_ids)
    elif c.finish_reason == "stop" and c.token_ids:  # SGLang's: the stop string, else the token (EOS too)
        reason["matched"] = c.stop_reason if c.stop_reason is not None else c.token_ids[-1]
    meta = {
        "id": out.request_id,
        "finish_reason": reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(c.token_ids),
        "weight_version": out.weight_version,
    }
    if logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.token_ids)]
    return {"text": text, "output_ids": c.token_ids, "meta_info": meta}


async def start_server(
    loop: EngineLoop, model_name: str, config: HttpServerConfig | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``loop``'s engine on the running asyncio loop.

    Returns:
        ``(runner, base_url)``; ``await runner.cleanup()`` stops the server.

    """
    server = EngineServer(loop, model_name, config)
    # handler_cancellation: a client that disconnects cancels its handler, and the engine aborts its request
    runner = web.AppRunner(server.app, access_log=None, handler_cancellation=True)
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
    p.add_argument(
        "--api-key-file",
        default=None,
        help="a file holding the bearer token; if it does not exist, a random one goes there",
    )
    p.add_argument("--admin-api-key-file", default=None, help="a file holding the admin routes' own bearer token")
    p.add_argument("--chat-template", default=None, help="'chatml_tools' (bundled) or a Jinja file")
    p.add_argument("--tool-call-parser", default="hermes", help="'hermes' or the import path of a ToolCallParser")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args(argv)
    key, key_file = cli_key(
        a.api_key or os.environ.get("MILES_RAY_ENGINE_API_KEY"), a.api_key_file, "miles_ray_engine_"
    )
    admin = Path(a.admin_api_key_file).read_text().strip() if a.admin_api_key_file else None
    config = HttpServerConfig(  # checked before the model loads
        host=a.host,
        port=a.port,
        api_key=key,
        admin_api_key=admin,
        chat_template=a.chat_template,
        tool_call_parser=a.tool_call_parser,
    )
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
        print(f"miles_ray engine serving {a.model_path} at {url} (bearer token in {key_file})", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
