"""The output process: a worker's token ids become text and Redis events off the engine's GIL.

``python -m worker.service.output_proc.process RFD WFD``: started by the engine process
(``link.py``) with a pipe each way. It loads the tokenizer (never torch), answers
``READY``, then turns ``StepBatch``es into text (``StreamTexts``: incremental
detokenizing, stop strings), publishes each output as a ``TokenEvent`` (pub/sub and the
replay list, one pipeline per pass) and sends back ``STOP`` for every stop string it
finds (the engine ends the request a step late; rows of a stream already ended here are
dropped, never published) and ``STATS``. A reader thread drains the pipe at once, so
when publishing falls behind, the next pass takes every batch waiting (coalescing): the
engine's write never blocks on Redis. It exits when the engine's end of the pipe closes.
With ``service`` in its ``CONFIG`` (the worker's ``FERRY_OUTPUT_PROCESS``) it runs
``output_service.serve`` instead: the requests' events and fenced writes, as the
engine loop makes them in-process.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time
from typing import Any

from worker.engine import EngineEnd, StreamTexts, TextOutput
from worker.service.output_proc import link as m
from worker.service.output_publish import Publisher, coalesce, token_event_bytes

__all__ = ["OutputProcess", "coalesce", "token_event_bytes"]

_STATS_EVERY_S = 0.5


class _Inbox:
    """Frames read off the pipe by a thread of their own; ``take`` empties it at once.

    A ``PING`` is not queued: the reader notes its number and wakes the main loop, which
    answers it (``answer``) between the messages it handles, so an answer says the main
    loop itself runs, however many messages wait before it."""

    def __init__(self, reader: m.FrameReader) -> None:
        self._reader = reader
        self._items: collections.deque[list[Any] | None] = collections.deque()
        self._ready = threading.Condition()
        self._ping = 0  # the latest PING's number read off the pipe
        self._answered = 0  # the latest answered (main loop only)
        threading.Thread(target=self._run, name="output-reader", daemon=True).start()

    def _run(self) -> None:
        while True:
            message = self._reader.read()
            with self._ready:
                if message is not None and message[0] == m.PING:
                    self._ping = message[1]
                else:
                    self._items.append(message)
                self._ready.notify()
            if message is None or message[0] == m.QUIT:
                return

    def answer(self, send: Any) -> None:
        """``PONG`` the latest ``PING`` if it is not answered yet (main loop only)."""
        ping = self._ping
        if ping != self._answered:
            self._answered = ping
            send([m.PONG, ping])

    def take(self, timeout: float) -> list[list[Any] | None]:
        with self._ready:
            if not self._items:
                self._ready.wait(timeout)
            items = list(self._items)
            self._items.clear()
        return items


class OutputProcess:
    def __init__(self, rfd: int, wfd: int) -> None:
        self._wfd = wfd
        self._reader = m.FrameReader(rfd)
        self._stops: list[list[Any]] = []
        # with ``collect``: every stream's text pieces (tests, bench), joined at the end
        self.texts: dict[str, list[str]] = {}
        self.stats = {"tokens": 0, "published": 0, "passes": 0, "batches": 0, "busy_s": 0.0,
                      "busy_cpu_s": 0.0}

    def _send(self, message: list[Any]) -> None:
        m.write_all(self._wfd, m.frame(message))

    def _on_stop(self, stream: int, stop_str: str) -> EngineEnd | None:
        self._stops.append([m.STOP, stream, stop_str])
        return None  # the engine hears of it with the next message: this stream ends here

    def run(self) -> int:
        config = self._reader.read()
        if config is None or config[0] != m.CONFIG:
            return 2
        options: dict[str, Any] = config[1]
        tokenizer = _load_tokenizer(options)
        if options.get("service"):  # the worker service's: events and fenced writes
            from worker.service.output_proc.service import locked, serve

            for sig in (signal.SIGINT, signal.SIGTERM):  # the engine process says when
                signal.signal(sig, signal.SIG_IGN)
            send = locked(self._send)
            send([m.READY, os.getpid()])
            return serve(options, tokenizer, _Inbox(self._reader), send)
        texts = StreamTexts(tokenizer, self._on_stop)
        publisher = Publisher(options.get("redis_url"), options.get("prefix", "ferry"),
                               int(options.get("ttl_s", 3600)))
        collect = bool(options.get("collect"))
        self._send([m.READY, os.getpid()])
        inbox = _Inbox(self._reader)
        last_stats = time.monotonic()
        while True:
            messages = inbox.take(_STATS_EVERY_S)
            start, start_cpu = time.perf_counter(), time.thread_time()
            outputs: list[TextOutput] = []
            done = False
            for message in messages:
                if message is None or message[0] == m.QUIT:
                    done = True
                    break
                if message[0] == m.BATCH:
                    self.stats["batches"] += 1
                    outputs += texts.apply(m.unpack_batch(message))
                inbox.answer(self._send)
            inbox.answer(self._send)
            for stop in self._stops:
                self._send(stop)
            self._stops.clear()
            outputs = coalesce(outputs)  # a pass behind by k steps: one event per stream
            publisher.publish(outputs)
            if collect:
                for out in outputs:
                    key = f"{out.request_id}/{out.index}"
                    self.texts.setdefault(key, []).append(out.text)
            if messages:
                self.stats["passes"] += 1
                self.stats["busy_s"] += time.perf_counter() - start
                self.stats["busy_cpu_s"] += time.thread_time() - start_cpu
            self.stats["tokens"] = texts.tokens_seen
            self.stats["dropped"] = texts.rows_dropped
            self.stats["torch_loaded"] = "torch" in sys.modules
            self.stats["published"] = publisher.published_tokens
            now = time.monotonic()
            if done or now - last_stats >= _STATS_EVERY_S:
                last_stats = now
                joined = {k: "".join(v) for k, v in self.texts.items()} if done and collect \
                    else None
                self._send([m.STATS, dict(self.stats), joined])
            if done:
                return 0


def _load_tokenizer(options: dict[str, Any]) -> Any:
    """The engine's tokenizer's Rust backend when it sent one (no transformers, no torch),
    else the tokenizer loaded the engine's way."""
    if options.get("decode_spec") is not None:
        from worker.engine import RustDecoder

        decoder = RustDecoder(options["decode_spec"])
        decoder.streams = decoder.streams and not options.get("window_decode")  # bench A/B
        if options.get("decode_stream"):  # bench A/B: DecodeStream, not the byte table
            decoder.byte_pieces = None
        return decoder
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(options["tokenizer"])


def main(argv: list[str]) -> int:
    rfd, wfd = int(argv[1]), int(argv[2])
    m.widen_pipe(rfd)
    try:
        return OutputProcess(rfd, wfd).run()
    except BrokenPipeError:
        return 0  # the engine process is gone: so is our reason to run


if __name__ == "__main__":
    sys.exit(main(sys.argv))
