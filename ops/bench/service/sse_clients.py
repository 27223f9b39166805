"""The gateway bench's HTTP clients: OpenAI streaming completions over raw asyncio sockets.

A client must never be the bottleneck of a gateway bench, so this one does per read, not
per event, what it can: HTTP/1.1 chunked decoding by hand, then one regex pass over the
SSE bytes for the ``<seq:publish us>`` markers the publisher put in each token's text.
It checks what it receives (every event once, in order, then the finish chunk and
``[DONE]``) and reports its own CPU time so the bench can show it was not saturated.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from array import array
from typing import Any

_MARK = re.compile(rb"<(\d+):(\d+)>")


class StreamCheck:
    """One stream's received events: order, duplicates, finish, ``[DONE]``."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.next_seq = 0
        self.errors: list[str] = []
        self.finished = False
        self.done = False

    def feed(self, sse: bytes, now: float, recv: array, pub: array) -> None:
        for m in _MARK.finditer(sse):
            seq = int(m[1])
            if seq != self.next_seq and len(self.errors) < 5:
                self.errors.append(f"seq {seq} where {self.next_seq} was due")
            self.next_seq = seq + 1
            recv.append(now)
            pub.append(int(m[2]) / 1e6)
        if b'"finish_reason":"length"' in sse:
            self.finished = True
        if b"data: [DONE]" in sse:
            self.done = True
        if b'"error"' in sse and len(self.errors) < 5:
            self.errors.append(f"error chunk: {sse[-300:]!r}")


async def _read_headers(reader: asyncio.StreamReader, rid: str) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        body = await reader.read(2000)
        raise RuntimeError(f"{rid}: HTTP {status.decode()}: {body[:300]!r}")
    if b"chunked" not in head.lower():
        raise RuntimeError(f"{rid}: response is not chunked")


async def follow(host: str, port: int, rid: str, chat: bool, check: StreamCheck,
                 opened: asyncio.Event, recv: array, pub: array) -> None:
    """POST one streaming request, then decode chunked SSE until the stream ends."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    if chat:
        path, payload = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 8000}
    else:
        path, payload = "/v1/completions", {"prompt": "x", "max_tokens": 8000}
    body = json.dumps({**payload, "stream": True, "request_id": rid}).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await _read_headers(reader, rid)
    opened.set()
    raw, sse = b"", b""
    while not check.done:
        data = await reader.read(1 << 16)
        if not data:
            break
        now = time.time()
        raw += data
        while True:  # chunked transfer encoding: "<hex size>\r\n<payload>\r\n"
            eol = raw.find(b"\r\n")
            if eol < 0:
                break
            size = int(raw[:eol], 16)
            if len(raw) < eol + 2 + size + 2:
                break
            sse += raw[eol + 2:eol + 2 + size]
            raw = raw[eol + 4 + size:]
            if size == 0:
                check.done = check.done or b"data: [DONE]" in sse
                break
        cut = sse.rfind(b"\n\n") + 2
        if cut >= 2:
            check.feed(sse[:cut], now, recv, pub)
            sse = sse[cut:]
    writer.close()


def run_clients(host: str, port: int, rids: list[str], chat: bool, opened: Any,
                results: Any) -> None:
    """Process entry point: follow ``rids`` concurrently; put a summary on ``results``."""

    async def main() -> dict[str, Any]:
        checks = [StreamCheck(rid) for rid in rids]
        events = [asyncio.Event() for _ in rids]
        recv, pub = array("d"), array("d")
        tasks = [asyncio.create_task(follow(host, port, c.rid, chat, c, e, recv, pub))
                 for c, e in zip(checks, events, strict=True)]
        await asyncio.gather(*(e.wait() for e in events))
        opened.set()
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.gather(*tasks)
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - wall0
        return {
            "streams": {c.rid: {"events": c.next_seq, "errors": c.errors,
                                "finished": c.finished, "done": c.done} for c in checks},
            "recv": recv.tobytes(), "pub": pub.tobytes(), "cpu_s": cpu, "wall_s": wall,
        }

    try:
        results.put(asyncio.run(main()))
    except BaseException as exc:  # report, so the bench fails with the reason
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise
