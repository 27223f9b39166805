"""The messages between a worker's engine process and its output process, msgpack-framed.

Frames are ``<u32 length><msgpack>`` on a pipe; a message is a list whose first item is
its kind. Engine -> output: ``CONFIG`` (once), ``BATCH`` (one ``StepBatch``; ends outside
a step, aborts, travel as a batch without rows), ``QUIT``. Output -> engine: ``READY``
(the tokenizer is loaded), ``STOP`` (a stop string ended a stream:
``Engine.finish_stream``), ``STATS``. In the worker service (``FERRY_OUTPUT_PROCESS``)
also engine -> output: ``JOB`` (an admitted request's ``ActiveJob``, pickled), ``END``
(a request stopped from outside: cancel, timeout; with its abort's ends), ``DROP`` (one
dropped without events: lease lost, shutdown); output -> engine: ``DISCARD`` (an entry
whose terminal event is written or whose lease is lost: no longer held), ``LOST`` (the
fence refused an event: stop the request), ``FINISHED`` (a terminal event's outcome,
for the stats and the fair ledger), ``GAPS`` (inter-token latencies binned per pass),
``STATS`` (its outbox's depth, for the heartbeat).
Liveness, both modes: the engine sends ``PING`` (a number) every so often; the output
process's main loop answers ``PONG`` with the latest number it has seen, between two
messages it handles and while it waits for room in its outbox (``output_link.py``: a
ping unanswered for ``output_hang_s`` is a hung output process).
Torch-free: the output process imports this and the engine's ``step_batch`` only.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack

from worker.engine import EngineEnd, StepBatch, StreamOpen

CONFIG, BATCH, QUIT, READY, STOP, STATS = "C", "B", "Q", "R", "S", "T"
JOB, END, DROP, DISCARD, LOST, FINISHED, GAPS = "J", "E", "D", "X", "L", "F", "G"
PING, PONG = "P", "O"
_LEN = struct.Struct("<I")
PIPE_BYTES = 1 << 20  # pipes raised to 1 MiB where the kernel allows (F_SETPIPE_SZ)


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
