"""The output process: a worker's token ids become text and Redis events off the engine's GIL.

``python -m worker.service.output_proc.process RFD WFD``: started by the worker's engine
process (``link.OutputLink``) with a pipe each way. It loads the tokenizer (never torch:
``load_tokenizer``), answers ``READY`` and runs ``service.serve``: the requests' text,
events and fenced writes, as the engine loop makes them in-process. A reader thread
(``Inbox``) drains the pipe at once, so the engine's write never blocks on Redis. It exits
when the engine's end of the pipe closes.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
from typing import Any

from worker.service.output_proc import link as m
from worker.service.output_proc.service import locked, serve


class Inbox:
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


def run(rfd: int, wfd: int) -> int:
    """Read ``CONFIG``, load the tokenizer, answer ``READY``, serve until the pipe closes."""
    reader = m.FrameReader(rfd)
    config = reader.read()
    if config is None or config[0] != m.CONFIG:
        return 2
    options: dict[str, Any] = config[1]
    tokenizer = load_tokenizer(options)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the engine process says when
        signal.signal(sig, signal.SIG_IGN)
    send = locked(lambda message: m.write_all(wfd, m.frame(message)))
    send([m.READY, os.getpid()])
    return serve(options, tokenizer, Inbox(reader), send)


def load_tokenizer(options: dict[str, Any]) -> Any:
    """The engine's decoder (``text_decoder``, the in-process output side's builder): the
    Rust backend the engine sent (no transformers, no torch), else the tokenizer loaded
    the engine's way."""
    from worker.engine import text_decoder

    def load() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(options["tokenizer"])

    return text_decoder(options.get("decode_spec"), load)


def main(argv: list[str]) -> int:
    rfd, wfd = int(argv[1]), int(argv[2])
    m.widen_pipe(rfd)
    try:
        return run(rfd, wfd)
    except BrokenPipeError:
        return 0  # the engine process is gone: so is our reason to run


if __name__ == "__main__":
    sys.exit(main(sys.argv))
