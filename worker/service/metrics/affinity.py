"""Prefix affinity's Prometheus series and heartbeat numbers: how the requests this worker
pulled were routed (offered to it by affinity, taken from another worker's offer after the
steal time, or not marked at all), how long marked ones waited before they were pulled,
and how many chunk hashes its board advertises. The cache hit rate beside them is the
engine's (``ferry_worker_prefix_cache_*``, ``prefix_hit_rate`` in the heartbeat).

Counted on the intake thread (plain ints and thread-safe Prometheus calls); the control
thread reads the totals into the heartbeat, where ``ferry top`` shows them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker.service.metrics.prometheus import PREFIX

ROUTES = ("affinity", "stolen", "unmarked")
"""How a pulled request was routed: marked for this worker; marked for another and taken
here after the steal time; not marked (no live worker held its prefix, or affinity off)."""

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def route_of(fields: Mapping[Any, Any], worker_id: str) -> tuple[str, float | None]:
    """A pulled stream entry's route (``ROUTES``) and, when it was marked, the seconds
    from its mark to its pull (the fair pull's ``marked``/``pulled`` fields)."""
    prefer = fields.get(b"prefer", fields.get("prefer"))
    if prefer is None:
        return "unmarked", None
    route = "affinity" if _text(prefer) == worker_id else "stolen"
    marked = fields.get(b"marked", fields.get("marked"))
    pulled = fields.get(b"pulled", fields.get("pulled"))
    try:
        return route, max(0, int(_text(pulled)) - int(_text(marked))) / 1000
    except (TypeError, ValueError):
        return route, None


class AffinityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pulled = Counter(PREFIX + "affinity_pulled_total",
                              "Requests pulled, by how they were routed "
                              "(affinity, stolen, unmarked).", ["route"], registry=registry)
        self.wait = Histogram(PREFIX + "affinity_wait_seconds",
                              "From a request's affinity mark to its pull, by route "
                              "(stolen: the steal wait).", ["route"],
                              buckets=_WAIT_BUCKETS, registry=registry)
        self.advertised = Gauge(PREFIX + "affinity_advertised_chunks",
                                "Chunk hashes this worker's affinity board advertises.",
                                registry=registry)
        self.counts = dict.fromkeys(ROUTES, 0)
        for route in ROUTES:
            self.pulled.labels(route=route)

    def pulled_entry(self, fields: Mapping[Any, Any], worker_id: str) -> str:
        """Count one pulled stream entry (its ``prefer``/``marked``/``pulled`` fields, set
        by the fair pull for a marked request); returns its route."""
        route, waited = route_of(fields, worker_id)
        if waited is not None:
            self.wait.labels(route=route).observe(waited)
        self.counts[route] += 1
        self.pulled.labels(route=route).inc()
        return route

    def heartbeat(self, advertised: int) -> dict[str, int]:
        self.advertised.set(advertised)
        return {"affinity_pulled": self.counts["affinity"],
                "affinity_stolen": self.counts["stolen"],
                "affinity_unmarked": self.counts["unmarked"],
                "affinity_advertised": advertised}
