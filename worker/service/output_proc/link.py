"""The pipe between a worker's engine process and its output process: the messages, their
frames, and the engine's end of it (``OutputLink``: start the process, feed it, hear it
back, notice when it dies or hangs).

Frames are ``<u32 length><msgpack>``; a message is a list whose first item is its kind.
Engine -> output: ``CONFIG`` (once), ``BATCH`` (one ``StepBatch``; ends outside a step,
aborts, travel as a batch without rows), ``QUIT``; in the worker service also ``JOB``
(an admitted request's ``ActiveJob``, pickled), ``END`` (a request stopped from outside:
cancel, timeout; with its abort's ends), ``DROP`` (one dropped without events: lease lost,
shutdown). Output -> engine: ``READY`` (the tokenizer is loaded), ``STOP`` (a stop string
ended a stream: ``Engine.finish_stream``), ``STATS``; in the service also ``DISCARD`` (an
entry no longer held), ``LOST`` (the fence refused an event: stop the request),
``FINISHED`` (a terminal event's outcome, for the stats and the fair ledger), ``GAPS``
(inter-token latencies binned per pass). One module for both ends' wire and the engine's
end: each step crosses all of it (pack, frame, write, poll), and the output process
imports nothing heavier from here than the standard library and ``worker.engine``'s
torch-free output types.

``OutputLink.start`` launches ``python -m worker.service.output_proc.process RFD WFD``
with a pipe each way (raised to 1 MiB), sends ``CONFIG`` and waits for ``READY``. A dead
output process raises ``OutputDied`` on the next ``send``/``poll``: the worker exits
``EXIT_OUTPUT_DIED``, its supervisor restarts it, and its requests resume from the
replay log like after any crash. A hung one is handled as a dead one: with ``hang_s``
(the worker's ``output_hang_s``) the link sends a ``PING`` every ``hang_s / 4`` from
``poll``; the output process's main loop answers ``PONG`` between the messages it handles
and while its outbox waits for Redis, and the link's reader thread notes the answer. A
ping unanswered for ``hang_s`` or a write that cannot go on for ``hang_s`` kills the
process and raises ``OutputDied``. This measures whether its main loop runs, not how far
behind it is. Until the first answer the bound is ``STARTUP_HANG_S`` at least.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from worker.engine import EngineEnd, StepBatch, StreamOpen

CONFIG, BATCH, QUIT, READY, STOP, STATS = "C", "B", "Q", "R", "S", "T"
JOB, END, DROP, DISCARD, LOST, FINISHED, GAPS = "J", "E", "D", "X", "L", "F", "G"
PING, PONG = "P", "O"
_LEN = struct.Struct("<I")
PIPE_BYTES = 1 << 20  # pipes raised to 1 MiB where the kernel allows (F_SETPIPE_SZ)
EXIT_OUTPUT_DIED = 71  # EX_OSERR: the output process died; the supervisor restarts the worker
STARTUP_HANG_S = 60.0  # the bound before the output process's first answer
_PINGS_PER_BOUND = 4


def widen_pipe(fd: int) -> None:
    """Raise a pipe's buffer so a burst of batches never blocks the engine's write."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (OSError, ImportError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size: the default size still works


def frame(message: list[Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Blocking reads of whole frames from a pipe; ``None`` at end of file."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def _exactly(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            chunk = os.read(self._fd, left)
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def read(self) -> list[Any] | None:
        head = self._exactly(_LEN.size)
        if head is None:
            return None
        body = self._exactly(_LEN.unpack(head)[0])
        return None if body is None else msgpack.unpackb(body, raw=False, strict_map_key=False)


def pack_batch(batch: StepBatch) -> list[Any]:
    return [BATCH, [list(_open_fields(o)) for o in batch.opened], batch.streams,
            batch.token_ids, batch.logprobs, batch.prompt_logprobs,
            [pack_end(e) for e in batch.ends], batch.cached]


def unpack_batch(message: list[Any]) -> StepBatch:
    _, opened, streams, tokens, lps, prompt_lps, ends, cached = message
    return StepBatch(
        opened=[StreamOpen(*o) for o in opened], streams=streams, token_ids=tokens,
        logprobs=None if lps is None else [_lp(x) for x in lps],
        prompt_logprobs={int(k): v for k, v in prompt_lps.items()},
        ends=[unpack_end(e) for e in ends], cached={int(k): v for k, v in cached.items()},
    )


def pack_opened(opened: list[StreamOpen]) -> list[Any]:
    return [list(_open_fields(o)) for o in opened]


def unpack_opened(packed: list[Any]) -> list[StreamOpen]:
    return [StreamOpen(*o) for o in packed]


def pack_end(end: EngineEnd) -> list[Any]:
    return [end.stream, end.finish_reason, end.stop_reason, end.error, end.num_prompt_tokens,
            end.num_output_tokens, end.row, end.error_kind, end.cumulative_logprob,
            end.prompt_logprobs]


def unpack_end(fields: list[Any]) -> EngineEnd:
    return EngineEnd(*fields)


def _open_fields(o: StreamOpen) -> tuple[Any, ...]:
    return (o.stream, o.request_id, o.index, o.prompt_tail, o.prior_output_ids, o.stop,
            o.include_stop_str_in_output, o.skip_special_tokens, o.num_prompt_tokens)


def _lp(x: Any) -> Any:
    """msgpack turns tuples into lists; the outputs carry (logprob, [(id, logprob)])."""
    return None if x is None else (x[0], [(t, p) for t, p in x[1]])


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
        self._reader = FrameReader(rfd)
        ready = self._reader.read()
        if ready is None or ready[0] != READY:
            raise OutputDied(f"output process did not start (exit {proc.poll()})")
        self._reading = threading.Thread(target=self._read_back, name="output-link",
                                         daemon=True)
        self._reading.start()

    @classmethod
    def start(cls, options: dict[str, Any], timeout_s: float = 120.0,
              hang_s: float | None = None,
              module: str = "worker.service.output_proc.process") -> OutputLink:
        """Launch ``python -m module`` with ``options`` as its ``CONFIG`` and wait until
        its tokenizer is loaded; with ``hang_s``, a hung one is ``OutputDied`` too."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        for fd in (to_child_w, from_child_w):
            widen_pipe(fd)
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), close_fds=True,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        write_all(to_child_w, frame([CONFIG, options]))
        return cls(proc, to_child_w, from_child_r, hang_s)

    def _read_back(self) -> None:
        while True:
            message = self._reader.read()
            if message is not None and message[0] == PONG:
                self._answered = message[1]
                continue
            self._back.put(message)
            if message is None:
                return

    def send(self, batch: StepBatch) -> None:
        if batch.is_empty:
            return
        self.send_message(pack_batch(batch))

    def send_ends(self, opened: list[StreamOpen], ends: list[EngineEnd]) -> None:
        """Ends outside a step (aborts), after any stream they need opened."""
        self.send(StepBatch(opened=opened, ends=ends))

    def send_message(self, message: list[Any]) -> None:
        try:
            self._write(frame(message))
        except (BrokenPipeError, OSError) as exc:
            raise OutputDied(f"output process gone: {exc}") from exc

    def _write(self, data: bytes) -> None:
        """All of ``data`` onto the pipe; with ``hang_s``, a pipe that takes nothing for
        that long (its reader thread is not reading) is a hung process."""
        if self.hang_s is None:
            write_all(self._wfd, data)
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
            self.send_message([PING, number])

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
            if message[0] == STOP:
                stops.append((message[1], message[2]))
            elif message[0] == STATS:
                self.stats = message[1]
                if message[2] is not None:
                    self.texts = message[2]
            elif self.on_message is not None:
                self.on_message(message)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the process to finish what it has, wait for its last stats, reap it."""
        self._closed = True
        with contextlib.suppress(OSError, OutputDied):
            self._write(frame([QUIT]))
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
