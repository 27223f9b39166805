"""The engine process's end of its output process: start it, feed it, hear it back.

``OutputLink.start`` launches ``python -m worker.service.output_proc.process RFD WFD`` with a
pipe each way (raised to 1 MiB), sends its ``CONFIG`` and waits for ``READY``. ``send``
writes a step's ``StepBatch`` (a few lists, msgpack); ``poll`` returns the stop strings
it found since (``Engine.finish_stream`` them) and keeps its latest ``STATS``. A dead
output process raises ``OutputDied`` on the next ``send``/``poll``: the worker exits
``EXIT_OUTPUT_DIED`` and its supervisor restarts it; its requests resume from the replay
log like after any crash.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.engine.output.step_batch import EngineEnd, StepBatch, StreamOpen
from worker.service.output_proc import messages as m

if TYPE_CHECKING:
    from worker.engine.engine import Engine

EXIT_OUTPUT_DIED = 71  # EX_OSERR: the output process died; the supervisor restarts the worker


class OutputDied(RuntimeError):
    """The output process exited or its pipe broke."""


class OutputLink:
    def __init__(self, proc: subprocess.Popen[bytes], wfd: int, rfd: int) -> None:
        self.proc = proc
        self._wfd = wfd
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
    def start(cls, options: dict[str, Any], timeout_s: float = 120.0) -> OutputLink:
        """Launch the output process with ``options`` (tokenizer path, redis_url, prefix,
        ttl_s, collect) and wait until its tokenizer is loaded."""
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
        return cls(proc, to_child_w, from_child_r)

    def _read_back(self) -> None:
        while True:
            message = self._reader.read()
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
            m.write_all(self._wfd, m.frame(message))
        except (BrokenPipeError, OSError) as exc:
            raise OutputDied(f"output process gone: {exc}") from exc

    def poll(self) -> list[tuple[int, str]]:
        """The stop strings found since the last call (other kinds go to ``on_message``,
        in order); raises ``OutputDied`` once everything it sent before dying is read."""
        stops: list[tuple[int, str]] = []
        while True:
            try:
                message = self._back.get_nowait()
            except queue.Empty:
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
        with contextlib.suppress(OSError):
            m.write_all(self._wfd, m.frame([m.QUIT]))
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
