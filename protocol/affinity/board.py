"""The affinity board: per worker, a bounded, expiring ZSET of the chunk hashes
(``chunks.py``) its prefix cache holds, scored by when they were last served.

A worker writes its key with every heartbeat (adds, removals for what its cache no longer
holds, a trim to ``MAX_ADVERTISED`` newest, and the heartbeat's TTL), so a worker that
dies stops advertising within its heartbeat TTL, and a live one never advertises more than
the bound. A producer reads every live worker's heartbeat and how many of a request's
leading chunks its board holds in one pipeline (ZMSCORE), and ``choose`` picks the worker
with the longest held prefix whose queue is not too deep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_ADVERTISED = 4096
"""Hashes one worker advertises at most (about 1M characters of prompts at 256 a chunk)."""


@dataclass(frozen=True)
class Candidate:
    """One live worker as the producer sees it for one request."""

    worker_id: str
    matched: int  # leading chunks of the request its board holds
    depth: int  # requests it took that are not running yet (its heartbeat + recent marks)
    draining: bool = False
    running: int = 0  # requests it is running (its heartbeat)

    @property
    def load(self) -> int:
        """Requests it holds: running, or taken and not running yet."""
        return self.depth + self.running


def queue_advertise(pipe: Any, key: str, added: Mapping[str, float], removed: Iterable[str],
                    ttl_ms: int, cap: int = MAX_ADVERTISED) -> None:
    """Queue one beat's update of a worker's board key."""
    gone = list(removed)
    if gone:
        pipe.zrem(key, *gone)
    if added:
        pipe.zadd(key, dict(added))
    pipe.zremrangebyrank(key, 0, -(cap + 1))
    pipe.pexpire(key, max(1, ttl_ms))


def leading(scores: list[Any] | None) -> int:
    """How many of the first chunks a ZMSCORE reply holds, without a gap."""
    n = 0
    for score in scores or []:
        if score is None:
            break
        n += 1
    return n


def choose(candidates: Iterable[Candidate], max_depth: int,
           load_chunks: float = 1.0) -> Candidate | None:
    """The worker to offer the request first, or None (unmarked: any worker pulls it).

    Among the live, non-draining workers that hold at least one of its chunks and have
    room, each is scored by what it would save minus what it already carries: ``matched -
    load_chunks * load`` (a request it holds is taken to cost as much as ``load_chunks``
    chunks of prefill), ties to the shallower queue. A conversation's own history (chunks
    only its holder has) therefore stays with its holder, while a prefix that several
    workers hold (a hot system prompt) goes to the less loaded of them, so a hot prefix
    spreads. A worker has no room when its queue is ``max_depth`` deeper than the
    shallowest live worker's: when every worker is as busy, the one holding the prefix
    still serves it soonest (a miss costs a prefill everywhere)."""
    pool = [c for c in candidates if not c.draining]
    floor = min((c.depth for c in pool), default=0)
    best: Candidate | None = None
    best_key = (-math.inf, 0)
    for c in pool:
        if c.matched <= 0 or c.depth >= floor + max_depth:
            continue
        key = (c.matched - load_chunks * c.load, -c.depth)
        if best is None or key > best_key:
            best, best_key = c, key
    return best
