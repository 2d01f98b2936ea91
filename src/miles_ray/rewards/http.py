"""Rewards over HTTP: ``HttpReward`` calls a remote reward server; ``reward_app`` serves any reward function.

The wire format is one JSON object per sample: ``POST /reward {"response": str, "entry": {...}}`` answers
``{"reward": float}``; ``POST /reward_group {"responses": [str, ...], "entry": {...}}`` answers
``{"rewards": [float, ...]}``. Anything else (a non-2xx status, a body without the field, a connection
error) raises in ``HttpReward``, and ``SafeReward`` turns that into a recorded failure with zero weight,
so a reward server that is down or slow never stops a run. The timeout is ``SafeReward``'s.

Usage::

    # on the reward machine (a sandbox, a judge model, ...)
    python -m miles_ray.rewards.http --fn my_pkg.rewards:exact_match --port 8100 --api-key-file KEY

    # in the driver
    reward = SafeReward(HttpReward("http://reward-host:8100", api_key=open("KEY").read()), timeout_s=30)
    groups = generate_groups(router, task, params, num_prompts, reward=reward)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

from miles_ray.callables import resolve_callable
from miles_ray.keys import bearer_matches, cli_key


class HttpReward:
    """Async reward function ``(text, entry) -> float`` backed by a remote ``/reward`` route."""

    def __init__(self, url: str, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpReward url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _post(self, route: str, payload: dict, field: str):
        import aiohttp

        async with aiohttp.ClientSession(headers=self.headers) as session:
            async with session.post(f"{self.url}{route}", json=payload) as resp:
                body = await resp.text()
                if resp.status // 100 != 2:
                    raise RuntimeError(f"reward server {self.url}{route} answered {resp.status}: {body[:200]}")
                data = await resp.json(content_type=None)
        if not isinstance(data, dict) or field not in data:
            raise RuntimeError(f"reward server {self.url}{route} answered without {field!r}: {body[:200]}")
        return data[field]

    async def __call__(self, text: str, entry: Any) -> float:
        """The reward of one response."""
        return await self._post("/reward", {"response": text, "entry": entry}, "reward")

    async def group(self, texts: list[str], entry: Any) -> list[float]:
        """The rewards of one prompt's responses, scored together (``/reward_group``)."""
        return await self._post("/reward_group", {"responses": texts, "entry": entry}, "rewards")


def reward_app(
    fn: str | Callable, group_fn: str | Callable | None = None, api_key: str | None = None, max_workers: int = 32
):
    """An aiohttp application serving ``fn`` at ``/reward`` (and ``group_fn`` at ``/reward_group``).

    ``fn(text, entry) -> float`` and ``group_fn(texts, entry) -> list[float]`` may be async; synchronous ones run
    on worker threads (``max_workers`` at once), so a slow call never holds up the others or the health route. A
    request without the fields, or a function that raises or returns a non-finite number, gets a 4xx/5xx answer
    naming the problem (the client records it as that sample's failure).
    """
    from aiohttp import web

    single = resolve_callable(fn, "reward fn")
    group = resolve_callable(group_fn, "reward group_fn") if group_fn is not None else None
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward-server")

    async def call(f, *args):
        if _is_async(f):
            return await f(*args)
        out = await asyncio.get_running_loop().run_in_executor(pool, f, *args)
        return await out if inspect.isawaitable(out) else out

    def bad(message: str, status: int = 400):
        return web.json_response({"error": message}, status=status)

    async def handle(request, f, in_field: str, out_field: str):
        if api_key and not bearer_matches(request.headers.get("Authorization", ""), api_key):
            return bad("missing or wrong bearer token", 401)
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return bad("body must be JSON")
        if not isinstance(body, dict) or in_field not in body:
            return bad(f"body needs {in_field!r} and 'entry'")
        try:
            value = await call(f, body[in_field], body.get("entry"))
            values = value if out_field == "rewards" else [value]
            if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
                raise ValueError(f"reward function returned {value!r}")
        except Exception as exc:  # the user's function may raise anything; report it to the client
            return bad(f"{type(exc).__name__}: {exc}", 500)
        return web.json_response({out_field: value})

    async def reward_route(request):
        return await handle(request, single, "response", "reward")

    async def group_route(request):
        return await handle(request, group, "responses", "rewards")

    async def health(request):
        return web.json_response({"ok": True})

    async def close_pool(app):
        pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application()
    app.on_cleanup.append(close_pool)
    app.router.add_post("/reward", reward_route)
    if group is not None:
        app.router.add_post("/reward_group", group_route)
    app.router.add_get("/health", health)
    return app


def _is_async(f: Callable) -> bool:
    """A coroutine function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__)


def main(argv: list[str] | None = None) -> None:
    """``python -m miles_ray.rewards.http --fn pkg.mod:fn [--group-fn pkg.mod:gfn] [--port 8100]``."""
    from aiohttp import web

    p = argparse.ArgumentParser(description="Serve a reward function over HTTP.")
    p.add_argument("--fn", required=True, help="reward function import path, (text, entry) -> float")
    p.add_argument("--group-fn", default=None, help="optional (texts, entry) -> list[float] import path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key", default=None, help="visible in ps: prefer MILES_RAY_REWARD_API_KEY or --api-key-file")
    p.add_argument(
        "--api-key-file", default=None, help="a file holding the bearer token (random one written if absent)"
    )
    args = p.parse_args(argv)
    given = args.api_key or os.environ.get("MILES_RAY_REWARD_API_KEY")
    key, where = cli_key(given, args.api_key_file, "miles_ray_reward_")  # every server has a key
    print(f"miles_ray reward server on {args.host}:{args.port} (bearer token in {where})", flush=True)
    web.run_app(reward_app(args.fn, args.group_fn, key), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
