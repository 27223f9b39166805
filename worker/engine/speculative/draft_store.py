"""The store of recent outputs that drafts are also taken from: per tenant, bounded, expiring.

Suffix automata cannot forget a prefix, so each tenant's part of the store is a queue of
segments, each its own automaton of up to ``segment_tokens`` tokens; a tenant's texts go
into its newest segment (a ``SEPARATOR`` between them). A request follows the store with a
``StoreCursor`` over *its own tenant's* segments only: one running match per segment,
stepped with each token the request is known to produce (a transition or two per
segment), a segment it has not seen yet walked once with the context's last tokens. The
longest match wins (the newest segment on a tie: recent traffic repeats most). No text of
one tenant is ever offered to another, and a query never walks another tenant's segments,
so a row's cost does not grow with other tenants' traffic.

Bounds: ``capacity_tokens`` over all tenants; past it the oldest segment of the tenant
holding the most tokens is dropped whole (a tenant's flood evicts its own texts first).
``ttl_s``: a segment takes texts for at most ``ttl_s / 8`` after its oldest, and is dropped
once its oldest text is ``ttl_s`` old (``expire``, run by the engine once a step), so no
text is offered past ``ttl_s``; texts go between 7/8 of it and all of it. Times are wall
clock (a fleet entry carries the time it was written). Memory is about 500 bytes per
stored token (Python dicts); the capacity bounds it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.engine.speculative.suffix_automaton import SEPARATOR, Match, SuffixAutomaton

_SPAN_PARTS = 8  # a segment spans at most ttl / 8 of texts' times


@dataclass(frozen=True)
class StoreMatch:
    """A match in the store: its length and the tokens that followed it there."""

    length: int
    continuation: list[int]


@dataclass(eq=False)
class Segment:
    """One automaton of a tenant's texts; ``born``: when its oldest text was written."""

    id: int
    automaton: SuffixAutomaton
    born: float


class DraftStore:
    """Recent texts (a prompt's tail and its output) per tenant, indexed for
    longest-suffix queries."""

    def __init__(self, capacity_tokens: int, segment_tokens: int | None = None,
                 ttl_s: float = math.inf, clock: Callable[[], float] = time.time) -> None:
        if capacity_tokens < 0 or not ttl_s >= 0:
            raise ValueError(f"capacity_tokens and ttl_s must be >= 0, got "
                             f"{capacity_tokens}, {ttl_s}")
        self.capacity_tokens = capacity_tokens
        self.segment_tokens = max(1, segment_tokens or max(1024, capacity_tokens // 8))
        self.ttl_s = ttl_s
        self._clock = clock
        self._tenants: dict[str, deque[Segment]] = {}
        self._held: dict[str, int] = {}  # tokens per tenant
        self.num_tokens = 0
        self._next_segment = 0
        self._next_expiry = math.inf  # when the oldest segment reaches the TTL
        self.texts_added = 0
        self.expired_segments = 0

    @property
    def num_segments(self) -> int:
        return sum(len(segments) for segments in self._tenants.values())

    @property
    def keeps_nothing(self) -> bool:
        return self.capacity_tokens == 0 or self.ttl_s == 0

    def tokens_of(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def add(self, tokens: list[int], tenant: str, created: float | None = None) -> bool:
        """Store one text of ``tenant`` written at ``created`` (wall clock; now if None);
        a text longer than a segment keeps only its last tokens, one already past the TTL
        is not stored. Returns whether it was stored."""
        now = self._clock()
        created = now if created is None else min(created, now)
        if self.keeps_nothing or not tokens or created <= now - self.ttl_s:
            return False
        self.expire(now)
        tokens = tokens[-self.segment_tokens:]
        segments = self._tenants.setdefault(tenant, deque())
        newest = segments[-1] if segments else None
        if newest is None or len(newest.automaton) + len(tokens) + 1 > self.segment_tokens \
                or created - newest.born > self.ttl_s / _SPAN_PARTS:
            newest = Segment(self._next_segment, SuffixAutomaton(), created)
            self._next_segment += 1
            segments.append(newest)
        automaton = newest.automaton
        before = len(automaton)
        if before:
            automaton.extend(SEPARATOR)
        automaton.extend_all(tokens)
        newest.born = min(newest.born, created)
        self._next_expiry = min(self._next_expiry, newest.born + self.ttl_s)
        grown = len(automaton) - before
        self._held[tenant] = self._held.get(tenant, 0) + grown
        self.num_tokens += grown
        self.texts_added += 1
        self._evict(newest)
        return True

    def _evict(self, fresh: Segment) -> None:
        """Over capacity: drop the oldest segment of the tenant holding the most tokens
        (never ``fresh``, the segment just written, so a text is always kept)."""
        while self.num_tokens > self.capacity_tokens:
            victims = [t for t, segments in self._tenants.items() if segments[0] is not fresh]
            if not victims:
                return
            self._drop(max(victims, key=self._held.__getitem__), 0)

    def _drop(self, tenant: str, index: int) -> None:
        segments = self._tenants[tenant]
        size = len(segments[index].automaton)
        del segments[index]
        self.num_tokens -= size
        self._held[tenant] -= size
        if not segments:
            del self._tenants[tenant], self._held[tenant]

    def expire(self, now: float | None = None) -> int:
        """Drop every segment whose oldest text is ``ttl_s`` old; returns how many. Costs a
        comparison until the oldest segment is due."""
        now = self._clock() if now is None else now
        if now < self._next_expiry:
            return 0
        cutoff, dropped = now - self.ttl_s, 0
        for tenant in list(self._tenants):
            segments = self._tenants[tenant]
            for index in range(len(segments) - 1, -1, -1):
                if segments[index].born <= cutoff:
                    self._drop(tenant, index)
                    dropped += 1
        self._next_expiry = min((s.born for segments in self._tenants.values()
                                 for s in segments), default=math.inf) + self.ttl_s
        self.expired_segments += dropped
        return dropped

    def segments(self, tenant: str) -> Sequence[Segment]:
        """``tenant``'s segments, oldest first (ids are never reused); read, never keep."""
        return self._tenants.get(tenant, ())

    def longest_match(self, context: list[int], limit: int, tenant: str) -> StoreMatch:
        """The longest suffix of ``context`` found in any of ``tenant``'s segments and up
        to ``limit`` tokens that followed it (none when nothing follows it before a
        seam)."""
        cursor = StoreCursor(self, tenant)
        cursor.reset(context)
        return cursor.best(limit)


class StoreCursor:
    """One request's running matches against each segment of its tenant's store."""

    def __init__(self, store: DraftStore, tenant: str, window: int = 32) -> None:
        self.store = store
        self.tenant = tenant
        self._matches: dict[int, tuple[int, int]] = {}  # segment id -> (state, length)
        self._context: list[int] = []
        self.window = window  # context tokens walked on a segment met for the first time

    def reset(self, context: list[int]) -> None:
        self._matches.clear()
        self._context = context[-self.window:]

    def advance(self, tokens: list[int]) -> None:
        """Step every followed segment's match with the request's new tokens."""
        matches = self._matches
        if matches:
            live = 0
            for item in self.store.segments(self.tenant):
                match = matches.get(item.id)
                if match is None:
                    continue
                state, length = match
                step = item.automaton.step
                for token in tokens:
                    state, length = step(state, length, token)
                matches[item.id] = state, length
                live += 1
            if live < len(matches):  # some were dropped from the store
                held = {item.id for item in self.store.segments(self.tenant)}
                for seg_id in [s for s in matches if s not in held]:
                    del matches[seg_id]
        self._context = (self._context + tokens)[-self.window:]

    def best(self, limit: int) -> StoreMatch:
        best_length, best_tokens = 0, []
        for item in reversed(self.store.segments(self.tenant)):
            segment = item.automaton
            if item.id not in self._matches:  # new to this request: walk the window once
                match = segment.longest_suffix(self._context)
                self._matches[item.id] = match.state, match.length
            state, length = self._matches[item.id]
            if length > best_length:
                end = segment.first_end(state)
                best_length = length
                best_tokens = segment.continuation(Match(length, end), limit)
        return StoreMatch(best_length, best_tokens)
