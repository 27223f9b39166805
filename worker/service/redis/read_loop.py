"""A worker thread's blocking-read loop on a connection of its own, that a lost Redis never ends.

The draft feed's tail (XREAD) and the tokenizer responder's threads (BLPOP) read this
way: each read blocks for at most a poll period, so a stop is noticed, and an outage is
met the same way in both: the first failure of a run is logged (the next ones are not,
until a read succeeds again), the client recovers (``redis_io.recover``: a cluster client
re-reads the topology) and the thread waits its backoff, or less if it is stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from worker.service.redis.connection import TRANSIENT_ERRORS, Backoff, WorkerSettings, recover


def read_until_stopped(settings: WorkerSettings, stop: threading.Event,
                       read: Callable[[Any], Any], handle: Callable[[Any, Any], None],
                       logger: Any, unavailable: str) -> None:
    """``handle(r, read(r))`` on a new connection ``r`` until ``stop`` is set; then close it.

    ``read`` should block for a bounded time (a stop waits that long at most). A transient
    Redis error in ``read`` logs ``unavailable`` on ``logger`` once per outage and backs
    off; errors raised by ``handle`` are the caller's to catch."""
    r = settings.connect()
    backoff = Backoff()
    try:
        while not stop.is_set():
            try:
                reply = read(r)
            except TRANSIENT_ERRORS as exc:
                if backoff.failures == 0:
                    logger.warning(unavailable, error=str(exc))
                recover(r)
                backoff.wait(stop)
                continue
            backoff.reset()
            handle(r, reply)
    finally:
        r.close()
