"""Serve an aiohttp application for real on 127.0.0.1, on a thread of the test process (the reward-server tests)."""

import asyncio
import contextlib
import socket
import threading


@contextlib.contextmanager
def serve_in_thread(app):
    """Yield the base URL of ``app`` served on a free port; stop it on exit."""
    from aiohttp import web

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    loop, started = asyncio.new_event_loop(), threading.Event()
    runner = web.AppRunner(app)

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    if not started.wait(30):
        raise TimeoutError("the app did not start listening within 30 s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
