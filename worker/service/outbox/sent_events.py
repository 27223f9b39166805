"""What the cluster outbox sent for the requests this worker holds, kept to refill a replay
log that a master's failover cut short.

A failover can lose the tail of a request's replay log (acknowledged by the old master,
not yet replicated); the next push then answers ``gap:<length>``. If this worker sent every
event from that length on, it sends them again (``repair``); a request that ended, lost its
lease or was refused is forgotten (``remember``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from worker.service.jobs import Outgoing

log = structlog.get_logger("ferry.worker.outbox")


class SentEvents:
    """Per request this worker holds: the payload of every event it wrote, by ``seq``."""

    def __init__(self, holds: Callable[[str], bool]) -> None:
        self.holds = holds  # whether the worker still holds a request (else forget its events)
        self.by_request: dict[str, dict[int, bytes]] = {}  # request id -> seq -> payload
        self.repaired = 0  # events sent again into logs a failover had cut short
        self._pushes = 0

    def repair(self, request_id: str, length: int, first: int
               ) -> list[tuple[int, bytes]] | None:
        """The events from ``length`` up to ``first`` (the batch's first seq), if this
        worker sent them all (they were lost with a failed master); None when it cannot
        fill the gap."""
        sent = self.by_request.get(request_id, {})
        missing = range(length, first)
        if not all(seq in sent for seq in missing):
            return None
        self.repaired += len(missing)
        log.warning("replay_log_repaired", request_id=request_id, from_seq=length,
                    events=len(missing))
        return [(seq, sent[seq]) for seq in missing]

    def remember(self, settled: list[tuple[Outgoing, Any]], payloads: dict[int, bytes]
                 ) -> None:
        """Keep what a push wrote (``payloads`` by ``id`` of the event); forget requests
        that ended or whose writes were refused."""
        for out, outcome in settled:
            if outcome == "ok" and not out.final:
                self.by_request.setdefault(out.request_id, {})[out.seq] = payloads[id(out)]
            elif out.final or outcome in ("lost", "foreign", "gap"):
                self.by_request.pop(out.request_id, None)
        self._pushes += 1
        if self._pushes % 256 == 0:  # requests that ended without an event (a lost lease)
            for rid in [r for r in self.by_request if not self.holds(r)]:
                del self.by_request[rid]
