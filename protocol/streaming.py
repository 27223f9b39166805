"""I/O-free logic shared by the sync and asyncio clients: ordering events by ``seq``.

Events reach a reader by two paths, pub/sub (live, but lossy on reconnect) and the replay
log (complete, but polled). The same event may arrive by both, and pub/sub may skip one;
``EventSequencer`` merges the two into exactly one ordered copy of each event.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from protocol.codec import decode_event
from protocol.models import GenerateRequest, JobStatus, TokenEvent, state_for_finish


class StreamTimeout(TimeoutError):
    """No terminal event arrived before the reader's deadline."""


class EventSequencer:
    """Delivers events in ``seq`` order, each once, and stops after the terminal one.

    Events ahead of the next expected ``seq`` are held back; ``has_gap`` then tells the
    caller to re-read the replay log, which always holds every published event.
    """

    def __init__(self, request_id: str, after_seq: int = -1) -> None:
        self.request_id = request_id
        self.last_seq = after_seq
        self.finished = False
        self._held: dict[int, TokenEvent] = {}

    @property
    def next_seq(self) -> int:
        return self.last_seq + 1

    @property
    def has_gap(self) -> bool:
        return bool(self._held)

    def push(self, events: Iterable[TokenEvent]) -> list[TokenEvent]:
        """Accept events in any order; return those now deliverable, in order."""
        ready: list[TokenEvent] = []
        for event in events:
            if self.finished or event.request_id != self.request_id:
                continue
            if event.seq == self.last_seq + 1 and not self._held:  # the usual case
                self.last_seq = event.seq
                ready.append(event)
                self.finished = event.finish_reason is not None
            elif event.seq > self.last_seq:
                self._held.setdefault(event.seq, event)
        while not self.finished and self.next_seq in self._held:
            event = self._held.pop(self.next_seq)
            self.last_seq = event.seq
            ready.append(event)
            if event.is_final:
                self.finished = True
                self._held.clear()
        return ready


class Outage:
    """Tolerates Redis connection errors for ``limit_s`` in a row, then re-raises.

    A redis-py pub/sub connection raises once when Redis goes away and reconnects (and
    resubscribes) on the next read; events published meanwhile are lost to pub/sub but
    are in the replay log, which the reader re-reads after the reconnect.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: float | None = None

    def ok(self) -> None:
        self._since = None

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since > self.limit_s:
            raise exc


def decode_log(raw_items: Sequence[Any]) -> list[TokenEvent]:
    return [decode_event(item) for item in raw_items]


def log_misaligned(events: Sequence[TokenEvent], start: int) -> bool:
    """True if ``LRANGE start -1`` did not begin at seq ``start``: read the whole log then."""
    return bool(events) and events[0].seq != start


def status_from_events(request: GenerateRequest, events: Sequence[TokenEvent]) -> JobStatus:
    """Fold a complete event sequence (ending with the terminal event) into a result."""
    if not events or not events[-1].is_final:
        raise ValueError("status_from_events: the sequence has no terminal event")
    final = events[-1]
    assert final.finish_reason is not None
    return JobStatus(
        request_id=request.request_id,
        state=state_for_finish(final.finish_reason),
        text="".join(e.text for e in events),
        token_ids=[t for e in events for t in e.token_ids],
        finish_reason=final.finish_reason,
        usage=final.usage,
        timings=final.timings,
        error=final.error,
        error_kind=final.error_kind,
        worker_id=final.worker_id,
        model=request.model,
        created_at=request.created_at,
    )
