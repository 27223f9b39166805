"""The engine process's end of its output process: start it, feed it, hear it back.

``OutputLink.start`` launches ``python -m worker.service.output_proc.process RFD WFD`` with a
pipe each way (raised to 1 MiB), sends its ``CONFIG`` and waits for ``READY``. ``send``
writes a step's ``StepBatch`` (a few lists, msgpack); ``poll`` returns the stop strings
it found since (``Engine.finish_stream`` them) and keeps its latest ``STATS``. A dead
output process raises ``OutputDied`` on the next ``send``/``poll``: the worker exits
``EXIT_OUTPUT_DIED`` and its supervisor restarts it; its requests resume from the replay
log like after any crash.

A hung one is handled as a dead one. With ``hang_s`` (the worker's ``output_hang_s``)
the link sends a ``PING`` every ``hang_s / 4`` from ``poll``; the output process's main
loop answers with ``PONG`` between the messages it handles and while its outbox waits for
Redis (``output_process._Inbox``), and the link's reader thread notes the answer. A ping
unanswered for ``hang_s`` (stopped, deadlocked, starved of any CPU) or a write to the pipe
that cannot go on for ``hang_s`` (its reader is not reading) kills the process and raises
``OutputDied``. What this measures is whether its main loop runs, not how far behind it
is: under heavy load it answers between two batches, so slow is not hung. Until the first
answer (the tokenizer loaded, the outbox started) the bound is ``STARTUP_HANG_S`` at least.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.engine import EngineEnd, StepBatch, StreamOpen
from worker.service.output_proc import messages as m

if TYPE_CHECKING:
    from worker.engine import Engine

EXIT_OUTPUT_DIED = 71  # EX_OSERR: the output process died; the supervisor restarts the worker
STARTUP_HANG_S = 60.0  # the bound before the output process's first answer
_PINGS_PER_BOUND = 4


class OutputDied(RuntimeError):
    """The output process exited or its pipe broke."""


class OutputLink:
    def __init__(self, proc: subprocess.Popen[bytes], wfd: int, rfd: int,
                 hang_s: float | None = None) -> None:
        self.proc = proc
        self._wfd = wfd
        self.hang_s = hang_s  # None: no liveness checks (the benches' standalone mode)
        self._pings: deque[tuple[int, float]] = deque()  # (number, sent at), unanswered
        self._answered = 0  # the latest PONG (written by the reader thread)
        self._pinged_at = 0.0
        self._closed = False
        if hang_s is not None:  # a write that cannot go on is watched (_write)
            os.set_blocking(wfd, False)
        self._back: queue.Queue[list[Any] | None] = queue.Queue()
        self.stats: dict[str, Any] = {}
        self.texts: dict[str, str] | None = None  # with ``collect``, after ``close``
        self.on_message: Callable[[list[Any]], None] | None = None  # the service's kinds
        self._reader = m.FrameReader(rfd)
        ready = self._reader.read()
        if ready is None or ready[0] != m.READY:
            raise OutputDied(f"output process did not start (exit {proc.poll()})")
        self._reading = threading.Thread(target=self._read_back, name="output-link",
                                         daemon=True)
        self._reading.start()

    @classmethod
    def start(cls, options: dict[str, Any], timeout_s: float = 120.0,
              hang_s: float | None = None) -> OutputLink:
        """Launch the output process with ``options`` (tokenizer path, redis_url, prefix,
        ttl_s, collect) and wait until its tokenizer is loaded; with ``hang_s``, a hung
        one is ``OutputDied`` too."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        for fd in (to_child_w, from_child_w):
            m.widen_pipe(fd)
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.service.output_proc.process",
             str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), close_fds=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        m.write_all(to_child_w, m.frame([m.CONFIG, options]))
        return cls(proc, to_child_w, from_child_r, hang_s)

    def _read_back(self) -> None:
        while True:
            message = self._reader.read()
            if message is not None and message[0] == m.PONG:
                self._answered = message[1]
                continue
            self._back.put(message)
            if message is None:
                return

    def send(self, batch: StepBatch) -> None:
        if batch.is_empty:
            return
        self.send_message(m.pack_batch(batch))

    def send_ends(self, opened: list[StreamOpen], ends: list[EngineEnd]) -> None:
        """Ends outside a step (aborts), after any stream they need opened."""
        self.send(StepBatch(opened=opened, ends=ends))

    def send_message(self, message: list[Any]) -> None:
        try:
            self._write(m.frame(message))
        except (BrokenPipeError, OSError) as exc:
            raise OutputDied(f"output process gone: {exc}") from exc

    def _write(self, data: bytes) -> None:
        """All of ``data`` onto the pipe; with ``hang_s``, a pipe that takes nothing for
        that long (its reader thread is not reading) is a hung process."""
        if self.hang_s is None:
            m.write_all(self._wfd, data)
            return
        view, blocked_since = memoryview(data), None
        while view:
            try:
                view = view[os.write(self._wfd, view):]
                blocked_since = None
            except BlockingIOError:
                now = time.monotonic()
                blocked_since = blocked_since or now
                if now - blocked_since > self._bound():
                    self._hung(f"its pipe took nothing for {now - blocked_since:.1f}s")
                select.select([], [self._wfd], [], 0.1)

    def _bound(self) -> float:
        assert self.hang_s is not None
        return self.hang_s if self._answered else max(self.hang_s, STARTUP_HANG_S)

    def _keepalive(self) -> None:
        """Ping every ``hang_s / 4``; ``OutputDied`` once a ping waits past the bound."""
        if self.hang_s is None or self._closed:
            return
        now = time.monotonic()
        while self._pings and self._pings[0][0] <= self._answered:
            self._pings.popleft()
        if self._pings and now - self._pings[0][1] > self._bound():
            self._hung(f"it answered nothing for {now - self._pings[0][1]:.1f}s")
        if now - self._pinged_at >= self.hang_s / _PINGS_PER_BOUND:
            self._pinged_at = now
            number = self._pings[-1][0] + 1 if self._pings else self._answered + 1
            self._pings.append((number, now))
            self.send_message([m.PING, number])

    def _hung(self, why: str) -> None:
        """Kill a hung output process (a stopped one too) and say so as ``OutputDied``."""
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        raise OutputDied(f"output process hung: {why} (output_hang_s {self.hang_s:g}); "
                         "killed")

    def poll(self) -> list[tuple[int, str]]:
        """The stop strings found since the last call (other kinds go to ``on_message``,
        in order); raises ``OutputDied`` once everything it sent before dying is read, or
        when it hung (``hang_s``)."""
        stops: list[tuple[int, str]] = []
        while True:
            try:
                message = self._back.get_nowait()
            except queue.Empty:
                self._keepalive()
                return stops
            if message is None:
                self._back.put(None)  # every later poll says so too
                raise OutputDied(f"output process exited ({self.proc.poll()})")
            if message[0] == m.STOP:
                stops.append((message[1], message[2]))
            elif message[0] == m.STATS:
                self.stats = message[1]
                if message[2] is not None:
                    self.texts = message[2]
            elif self.on_message is not None:
                self.on_message(message)

    def step(self, engine: Engine) -> StepBatch:
        """One engine step through the output process: the stop strings it found first
        (each ends its request a step late), then the step's batch sent over."""
        for stream, stop_str in self.poll():
            engine.finish_stream(stream, "stop", stop_str)
        batch = engine.step()
        self.send(batch)
        return batch

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the process to finish what it has, wait for its last stats, reap it."""
        self._closed = True
        with contextlib.suppress(OSError, OutputDied):
            self._write(m.frame([m.QUIT]))
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:  # stuck: what it did not write, a resume redoes
            self.proc.kill()
            self.proc.wait(10.0)
        finally:
            os.close(self._wfd)
        self._reading.join(5.0)  # everything it wrote before exiting is read
        with contextlib.suppress(OutputDied):
            self.poll()
