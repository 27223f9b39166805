"""What this worker advertises on its affinity board, and how it pulled what it served.

The intake records the chunk hashes (``protocol/affinity/chunks.py``) of every request it
starts: once that request's prompt is prefilled, its blocks are in this worker's prefix
cache. The cache evicts least recently used blocks once it is full, so the book mirrors
that in text space: each chunk weighs its share of the request's prompt tokens (the fair
pull's estimate, ``prompt_hint``), and the least recently served chunks are dropped while
the total outweighs the cache (device plus host tier, in tokens). What the control thread
takes with each heartbeat (``take``) is what changed since the last one; it writes the
adds, the drops and the key's TTL in one pipeline (``board.queue_advertise``).

The mirror is an estimate: a chunk dropped here may still be cached (a missed preference,
the request is pulled as without affinity), one kept here may be gone (the preferred
worker recomputes it, as any worker would have). Either way the cost is bounded by what
affinity off costs, never a wrong answer: the cache itself decides what is reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from protocol.affinity.board import MAX_ADVERTISED
from protocol.affinity.chunks import prefix_chunks
from protocol.models import GenerateRequest
from protocol.tenants.fair import prompt_hint


@dataclass
class Changes:
    """The board's changes since the last beat."""

    added: dict[str, float] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)


class AffinityBook:
    """LRU mirror of the prefix cache in chunk hashes; thread-safe (intake adds, control
    takes)."""

    def __init__(self, capacity_tokens: int, cap: int = MAX_ADVERTISED) -> None:
        self.capacity_tokens = max(1, capacity_tokens)
        self.cap = cap
        self._lock = threading.Lock()
        self._held: OrderedDict[str, float] = OrderedDict()  # hash -> its tokens
        self._tokens = 0.0
        self._changes = Changes()

    def served(self, request: GenerateRequest, now: float | None = None) -> None:
        """Record that this worker is prefilling ``request``'s prompt."""
        hashes = prefix_chunks(request)
        if not hashes:
            return
        weight = prompt_hint(request) / max(1, len(hashes))
        now = time.time() if now is None else now
        with self._lock:
            for h in hashes:
                if h in self._held:
                    self._held.move_to_end(h)
                else:
                    self._held[h] = weight
                    self._tokens += weight
                self._changes.added[h] = now
                self._changes.removed.discard(h)
            while self._held and (self._tokens > self.capacity_tokens
                                  or len(self._held) > self.cap):
                gone, w = self._held.popitem(last=False)
                self._tokens -= w
                self._changes.added.pop(gone, None)
                self._changes.removed.add(gone)

    def take(self, full: bool = False) -> Changes:
        """The changes since the last call (the control thread, once a beat); ``full``:
        everything held, as adds (to rewrite a board that expired or was never written)."""
        with self._lock:
            changes, self._changes = self._changes, Changes()
            if full:
                now = time.time()
                changes = Changes({h: changes.added.get(h, now) for h in self._held})
        return changes

    def __len__(self) -> int:
        return len(self._held)
