"""The store of recent outputs that drafts are also taken from: bounded, oldest out first.

Suffix automata cannot forget a prefix, so the store is a queue of segments, each its own
automaton of up to ``segment_tokens`` tokens; texts go into the newest segment (a
``SEPARATOR`` between them) and the oldest segment is dropped whole once the store holds
more than ``capacity_tokens``. A request follows the store with a ``StoreCursor``: one
running match per segment, stepped with each token the request is known to produce (a
transition or two per segment), a segment it has not seen yet walked once with the
context's last tokens. The longest match wins (the newest segment on a tie: recent traffic
repeats most). Memory is about 500 bytes per stored token (Python dicts); the capacity
bounds it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from worker.engine.speculative.suffix_automaton import SEPARATOR, Match, SuffixAutomaton


@dataclass(frozen=True)
class StoreMatch:
    """A match in the store: its length and the tokens that followed it there."""

    length: int
    continuation: list[int]


class DraftStore:
    """Recent texts (a prompt's tail and its output) indexed for longest-suffix queries."""

    def __init__(self, capacity_tokens: int, segment_tokens: int | None = None) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.segment_tokens = max(1, segment_tokens or max(1024, capacity_tokens // 8))
        self._segments: deque[tuple[int, SuffixAutomaton]] = deque()
        self._next_segment = 0
        self.texts_added = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(segment) for _, segment in self._segments)

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def add(self, tokens: list[int]) -> None:
        """Store one text; a text longer than a segment keeps only its last tokens."""
        if self.capacity_tokens == 0 or not tokens:
            return
        tokens = tokens[-self.segment_tokens:]
        if not self._segments or len(self._segments[-1][1]) + len(tokens) + 1 \
                > self.segment_tokens:
            self._segments.append((self._next_segment, SuffixAutomaton()))
            self._next_segment += 1
        segment = self._segments[-1][1]
        if len(segment):
            segment.extend(SEPARATOR)
        segment.extend_all(tokens)
        self.texts_added += 1
        while len(self._segments) > 1 and self.num_tokens > self.capacity_tokens:
            self._segments.popleft()

    def segments(self) -> list[tuple[int, SuffixAutomaton]]:
        """(segment id, automaton), oldest first; ids are never reused."""
        return list(self._segments)

    def longest_match(self, context: list[int], limit: int) -> StoreMatch:
        """The longest suffix of ``context`` found in any segment and up to ``limit``
        tokens that followed it (none when nothing follows it before a seam)."""
        cursor = StoreCursor(self)
        cursor.reset(context)
        return cursor.best(limit)


class StoreCursor:
    """One request's running matches against each segment of a ``DraftStore``."""

    def __init__(self, store: DraftStore, window: int = 32) -> None:
        self.store = store
        self._matches: dict[int, tuple[int, int]] = {}  # segment id -> (state, length)
        self._context: list[int] = []
        self.window = window  # context tokens walked on a segment met for the first time

    def reset(self, context: list[int]) -> None:
        self._matches.clear()
        self._context = context[-self.window:]

    def advance(self, tokens: list[int]) -> None:
        """Step every followed segment's match with the request's new tokens."""
        segments = dict(self.store.segments())
        for seg_id in list(self._matches):
            segment = segments.get(seg_id)
            if segment is None:  # dropped from the store
                del self._matches[seg_id]
                continue
            state, length = self._matches[seg_id]
            for token in tokens:
                state, length = segment.step(state, length, token)
            self._matches[seg_id] = state, length
        self._context = (self._context + tokens)[-self.window:]

    def best(self, limit: int) -> StoreMatch:
        best_length, best_tokens = 0, []
        for seg_id, segment in reversed(self.store.segments()):
            if seg_id not in self._matches:  # new to this request: walk the window once
                match = segment.longest_suffix(self._context)
                self._matches[seg_id] = match.state, match.length
            state, length = self._matches[seg_id]
            if length > best_length:
                end = segment.first_end(state)
                best_length = length
                best_tokens = segment.continuation(Match(length, end), limit)
        return StoreMatch(best_length, best_tokens)
