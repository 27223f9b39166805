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

PRIORITY_BANDS = ("high", "normal", "low")
"""Request-stream lanes, in the order workers read them. A request's band follows from its
``priority`` (lower runs first): < 0 is ``high``, 0 is ``normal``, > 0 is ``low``."""


def band_of(priority: int) -> str:
    """The lane of a request with this ``priority`` (see ``PRIORITY_BANDS``)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


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
        """The ``normal`` lane: stream of msgpack GenerateRequests (field ``data``) of
        priority 0; never trimmed by producers. Its name predates the lanes."""
        return f"{self.prefix}:requests"

    def requests_band(self, band: str) -> str:
        """The request stream of one lane: ``{prefix}:requests:high``, ``{prefix}:requests``
        (normal), ``{prefix}:requests:low``."""
        if band not in PRIORITY_BANDS:
            raise ValueError(f"band: {band!r} is not one of {', '.join(PRIORITY_BANDS)}")
        return self.requests if band == "normal" else f"{self.requests}:{band}"

    def requests_for(self, priority: int) -> str:
        """The request stream a request of this ``priority`` is enqueued on."""
        return self.requests_band(band_of(priority))

    @property
    def request_streams(self) -> tuple[str, ...]:
        """Every lane's stream, highest priority first: the order workers read them in."""
        return tuple(self.requests_band(band) for band in PRIORITY_BANDS)

    @property
    def group(self) -> str:
        """The consumer group all workers read in; each lane's stream has one by this name."""
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
