"""What this worker advertises on its affinity board, and how it pulled what it served.

The engine loop books the chunk hashes (``protocol/affinity/chunks.py``) of every request
it admits (its prompt is prefilled into this worker's prefix cache right after), with the
hashes of the prompt blocks each chunk's text needs (``chains.py``). When the cache lets
a block go for good (``worker/engine/kv/block_evictions.py``), the loop hands its hash to
``evicted``, which drops the chunks that need it and every later chunk of their chains:
the book follows the cache's own evictions. What the control thread takes with each heartbeat
(``take``) is what changed since the last one; it writes the adds, the drops and the key's
TTL in one pipeline (``board.queue_advertise``).

A backstop bounds what the hook cannot see (the blocks of a request cancelled before its
prefill computed them, which never enter the cache; a prompt with no full block): each
chunk weighs its share of the request's prompt tokens (the fair pull's estimate,
``prompt_hint``), and the least recently served chunks, with their later chunks, are
dropped while the total outweighs ``capacity_tokens`` (the worker gives it twice the
cache's tokens, ``setup.py``) or they outnumber the board's bound. What is left of the
error costs what affinity off costs, never a wrong answer: a chunk dropped while still
cached is a missed preference; one kept a beat after its blocks left makes the preferred
worker recompute it, as any worker would. The cache itself decides what is reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.affinity.board import MAX_ADVERTISED
from protocol.models import GenerateRequest
from worker.service.affinity.chains import ChunkChains, Prefix, prefix_of


@dataclass
class Changes:
    """The board's changes since the last beat."""

    added: dict[str, float] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)


class AffinityBook:
    """The chunks this worker's prefix cache holds; thread-safe (the engine loop books and
    reports evictions, the control thread takes the changes)."""

    def __init__(self, capacity_tokens: int, cap: int = MAX_ADVERTISED) -> None:
        self.capacity_tokens = max(1, capacity_tokens)
        self.cap = cap
        self._lock = threading.Lock()
        self._held: OrderedDict[str, float] = OrderedDict()  # hash -> its tokens
        self._tokens = 0.0
        self._chains = ChunkChains()
        self._changes = Changes()

    def served(self, request: GenerateRequest | Prefix | None,
               owned: Iterable[tuple[bytes, int]] = (), now: float | None = None) -> None:
        """Record that this worker is prefilling a request's prompt (given as the request
        or its ``prefix_of``); ``owned``: its prompt's blocks, as (block hash, the index
        of the first chunk that needs it) (``chains.block_owners``)."""
        prefix = prefix_of(request) if isinstance(request, GenerateRequest) else request
        if prefix is None:
            return
        now = time.time() if now is None else now
        with self._lock:
            for h in prefix.chunks:
                if h in self._held:
                    self._held.move_to_end(h)
                else:
                    self._held[h] = prefix.weight
                    self._tokens += prefix.weight
                self._changes.added[h] = now
                self._changes.removed.discard(h)
            self._chains.add(prefix.chunks, owned)
            while self._held and (self._tokens > self.capacity_tokens
                                  or len(self._held) > self.cap):
                self._drop(next(iter(self._held)))

    def evicted(self, block_hashes: Iterable[bytes]) -> int:
        """The prefix cache let these blocks go for good: drop the chunks that need them
        and every later chunk of their chains. Returns the chunks dropped."""
        dropped = 0
        with self._lock:
            for block in block_hashes:
                for chunk in self._chains.needing(block):
                    dropped += self._drop(chunk)
        return dropped

    def _drop(self, chunk: str) -> int:
        """Drop ``chunk`` and its later chunks (under the lock); returns how many."""
        gone = [c for c in self._chains.with_later(chunk) if c in self._held]
        for c in gone:
            self._tokens -= self._held.pop(c)
            self._chains.forget(c)
            self._changes.added.pop(c, None)
            self._changes.removed.add(c)
        return len(gone)

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
