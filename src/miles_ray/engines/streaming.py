"""Server-sent events for the OpenAI routes: incremental detokenisation, merged token streams, the SSE writer.

A streamed response carries the same tokens, logprobs and final text as the non-streamed one: text deltas
come from ``IncrementalDetokenizer`` (vLLM's prefix/read-offset scheme: a delta is emitted only once it no
longer ends in a partial UTF-8 character), and the last chunk of a choice adds whatever the full decode holds
beyond the deltas sent, so the deltas join into exactly the non-streamed ``text``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, decoded over a short window rather than from the start."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: context so that a token's leading space decodes as in the full text
        self._read = 0  # tokens already turned into text

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes ("" while a character is still partial)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


def rest_of(text: str, sent: str) -> str:
    """What ``text`` (the full decode) holds beyond ``sent`` (the deltas streamed so far)."""
    return text[len(sent) :] if text.startswith(sent) else ""


def sendable(text: str, marks: list[str], keep: bool = False) -> str:
    """What of a growing ``text`` a stream may send yet.

    That is ``text`` up to the first of ``marks`` in it (a stop string, a tool call's opening), or through it with
    ``keep``; else all of it with ``keep``, and without, all but a tail that may be the start of one, which the next
    tokens decide. The response's whole text is cut the same way, so what was sent is always a prefix of it.
    """
    found = [(text.find(m), text.find(m) + len(m)) for m in marks if m in text]
    if found:
        return text[: min(end if keep else start for start, end in found)]
    if keep:
        return text
    for cut in range(min(max(map(len, marks), default=1) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-cut:]) for m in marks):
            return text[:-cut]
    return text


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several streams as they come, as ``(stream index, item)``; an error in one ends all.

    Closing this iterator cancels every stream, so the engine aborts requests nobody reads any more.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((k, item))
        except Exception as exc:
            queue.put_nowait((k, exc))
        queue.put_nowait((k, done))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            k, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventStream:
    """One SSE response: ``data: {json}`` events, then ``data: [DONE]``."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    async def open(self) -> None:
        """Send the headers (status 200): errors after this go in the stream, not in the status."""
        await self.response.prepare(self.request)

    async def send(self, payload: dict) -> None:
        """One event."""
        await self.response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    async def close(self) -> web.StreamResponse:
        """The final ``[DONE]`` event."""
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
