"""The fair share's second charge: what a finished request really cost its tenant.

The fair pull (``protocol.tenants.fair``) charges a tenant's virtual token counter the request's
prompt estimate when a worker takes it; when the request ends the engine loop notes here
what it really used (prompt and generated tokens), and the intake thread, before its next
pull, adds the difference to the counter (divided by the tenant's weight, in Redis). The
counters so follow the tokens actually served, as VTC's do; a request's generated tokens
count from its end (a tenant's counter lags by what its running requests have generated
so far, as every tenant's does in proportion to its running requests).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from protocol.cluster.nodes import node_pipeline
from protocol.tenants import fair


class FairLedger:
    """Corrections waiting to be charged: (lane stream, tenant, tokens). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owed: dict[tuple[str, str], int] = {}

    def note(self, stream: str, tenant: str, used: int, charged: int) -> None:
        """Engine loop: a request of ``tenant`` from ``stream`` used ``used`` tokens and was
        charged ``charged`` by the pull."""
        if used == charged:
            return
        with self._lock:
            key = (stream, tenant)
            self._owed[key] = self._owed.get(key, 0) + used - charged

    def settle(self, r: Any, streams: Collection[str] | None = None) -> int:
        """Intake thread: charge every correction noted so far (for the lanes ``streams``,
        one shard's say; None: all) in one pipeline; returns how many counters changed. On
        a Redis error the corrections are kept for next time."""
        with self._lock:
            if streams is None:
                owed, self._owed = self._owed, {}
            else:
                owed = {key: n for key, n in self._owed.items() if key[0] in streams}
                for key in owed:
                    del self._owed[key]
        if not owed:
            return 0
        try:  # one shard's lanes share a slot: one node's pipeline
            pipe = r.pipeline(transaction=False) if streams is None \
                else node_pipeline(r, next(iter(owed))[0])
            for (stream, tenant), tokens in owed.items():
                fair.queue_charge(pipe, stream, tenant, tokens)
            pipe.execute()
        except BaseException:
            with self._lock:
                for key, tokens in owed.items():
                    self._owed[key] = self._owed.get(key, 0) + tokens
            raise
        return len(owed)


def fair_fields(fields: Any) -> tuple[str, int]:
    """An entry's ``origin`` ('' if none) and ``cost`` (what the fair pull charged; an
    entry no pull moved was charged ``DIRECT_COST``, ``protocol.tenants.fair``)."""
    origin = fields.get(b"origin", fields.get("origin", b""))
    cost = fields.get(b"cost", fields.get("cost"))
    try:
        charged = int(cost) if cost is not None else fair.DIRECT_COST
    except ValueError:
        charged = fair.DIRECT_COST
    return origin.decode() if isinstance(origin, bytes) else str(origin), charged
