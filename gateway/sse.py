"""Server-sent events: framing, and a response that notices a client hanging up at once.

Starlette's StreamingResponse on uvicorn only learns of a disconnect when it next writes,
and may leave the body generator unclosed. A generation should stop the moment nobody
reads it (the GPU time is the expensive part), so ``EventStreamResponse`` listens for
``http.disconnect`` while streaming and always runs ``on_close`` when it ends, however it
ends; handlers pass a callback that cancels the job unless it already finished.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency; the gateway bench hides it
    _orjson = None  # type: ignore[assignment]

DONE = b"data: [DONE]\n\n"
PING = b": keep-alive\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_bytes(data: Any) -> bytes:
    """Compact JSON as UTF-8 bytes: orjson on the token path, ``json`` where it cannot
    (orjson refuses lone surrogates, which ``json`` escapes) or is not installed."""
    if _orjson is not None:
        try:
            return _orjson.dumps(data)  # type: ignore[no-any-return]
        except TypeError:  # orjson.JSONEncodeError; e.g. a lone surrogate in a str
            pass
    return json.dumps(data, separators=(",", ":")).encode()


def sse(data: Any, event_id: int | None = None, event: str | None = None) -> bytes:
    """One SSE message; ``data`` is JSON-encoded unless it is already a string.

    Encoded JSON never holds a raw newline, so it is one ``data:`` line."""
    if event_id is None and event is None and not isinstance(data, str):
        return b"data: " + json_bytes(data) + b"\n\n"
    payload = data if isinstance(data, str) else json_bytes(data).decode()
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in payload.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


class EventStreamResponse(Response):
    """``text/event-stream`` body from an async iterator of ready-framed chunks."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def pump() -> None:
                    await self._pump(send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(pump)
                group.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                if self.on_close is not None:
                    await self.on_close()

    async def _pump(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # ASGI 2.4 servers report a vanished client this way
            return
