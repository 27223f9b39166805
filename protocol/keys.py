"""Every Redis key, stream, consumer group and channel name Ferry uses, in one place.

All names share one prefix (default ``ferry``) so several deployments can share a Redis
and so ``SCAN MATCH ferry:*`` finds everything. Per-request names embed the request id,
which the protocol restricts to key-safe characters (see ``protocol.models.ID_PATTERN``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "ferry"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Keys:
    """Name factory: ``Keys("ferry").job("abc") == "ferry:job:abc"``."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix: {self.prefix!r} must match {_PREFIX_RE.pattern}")

    # --- shared -------------------------------------------------------------------------
    @property
    def requests(self) -> str:
        """Stream of msgpack GenerateRequests (field ``data``); never trimmed by producers."""
        return f"{self.prefix}:requests"

    @property
    def group(self) -> str:
        """The one consumer group all workers read ``requests`` in."""
        return f"{self.prefix}-workers"

    @property
    def dead_letter(self) -> str:
        """Stream of entries no worker could decode or run, with the reason."""
        return f"{self.prefix}:requests:dead"

    @property
    def control(self) -> str:
        """Pub/sub channel for msgpack Cancel messages, heard by every worker."""
        return f"{self.prefix}:control"

    @property
    def workers(self) -> str:
        """Set of worker ids that have sent a heartbeat; stale members are pruned by readers."""
        return f"{self.prefix}:workers"

    @property
    def restarts(self) -> str:
        """HASH of process restarts recorded by ``ferry up``'s supervisor (for ``ferry top``):
        field ``{launcher}/{process}``, value a JSON record (``ferry/recovery.py``); TTL."""
        return f"{self.prefix}:restarts"

    # --- per request --------------------------------------------------------------------
    def tokens(self, request_id: str) -> str:
        """Pub/sub channel carrying the request's msgpack TokenEvents."""
        return f"{self.prefix}:tokens:{request_id}"

    def events(self, request_id: str) -> str:
        """LIST replaying the same TokenEvents: element i is the event with seq i (TTL)."""
        return f"{self.prefix}:events:{request_id}"

    def job(self, request_id: str) -> str:
        """HASH with the job's state and, once finished, its result (TTL)."""
        return f"{self.prefix}:job:{request_id}"

    def cancelled(self, request_id: str) -> str:
        """STRING (the reason) marking a request cancelled, so a worker skips it (TTL)."""
        return f"{self.prefix}:cancelled:{request_id}"

    # --- per worker ---------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        """STRING holding the worker's msgpack WorkerHeartbeat; its TTL is its liveness."""
        return f"{self.prefix}:worker:{worker_id}"
