"""Suffix decoding's proposer: drafts from a request's own tokens and from the store.

Each request keeps an automaton of its own text (prompt, then every token it is known to
have produced). After each token, the longest suffix of the text that also occurred
earlier is the automaton's last state's suffix link; the draft is what followed its
*latest* earlier occurrence (``SuffixAutomaton.recent_match``), read as a loop: when the
text runs out, the span after that occurrence repeats (``periodic``), since a model that
repeats a span tends to keep repeating it. The store of past outputs is followed with one
running match per segment of the request's own tenant (``StoreCursor``: its retries,
repeated batch lines, the fleet's outputs of the same tenant). The longer match wins (the
request's own on a tie), and the draft grows with it: nothing under ``min_match_tokens``,
then ``draft_per_matched`` tokens per matched token up to the limit; the back-off cuts it
to what is worth verifying.

Only tokens a request is known to have produced are observed: drafts never enter the
index, so a rejected draft leaves nothing behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore, StoreCursor
from worker.engine.speculative.suffix_automaton import SuffixAutomaton


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for a row and the match they came from (``source``: own|store)."""

    tokens: list[int]
    match_length: int
    source: str


NO_DRAFT = Draft([], 0, "none")


def periodic(tokens: list[int], end: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens after ``tokens[end]``, the text read as repeating past its
    end: the span after the match's earlier occurrence is the loop's period (a model that
    repeats itself goes on repeating), so the draft need not stop where the text does."""
    out = tokens[end + 1:end + 1 + limit]
    period = len(out)
    if period == 0 or period >= limit:
        return out
    repeats = -(-limit // period)  # ceil
    return (out * repeats)[:limit]


class RequestDrafter:
    """One request's own index (its prompt and known output) and its store cursor."""

    def __init__(self, prompt: list[int], cursor: StoreCursor) -> None:
        self.automaton = SuffixAutomaton(track_recent=True)
        self.cursor = cursor
        cursor.reset(prompt)
        self.automaton.extend_all(prompt)

    @property
    def tokens(self) -> list[int]:
        return self.automaton.tokens

    def observe(self, tokens: list[int]) -> None:
        """Tokens the request is known to have produced."""
        self.automaton.extend_all(tokens)
        self.cursor.advance(tokens)

    def own_match(self, limit: int) -> tuple[int, list[int]]:
        """Length of the longest suffix of the text that occurred before, and up to
        ``limit`` tokens after its latest earlier occurrence, the text read as repeating
        (``periodic``)."""
        length, end = self.automaton.recent_match()
        if length == 0:
            return 0, []
        return length, periodic(self.automaton.tokens, end, limit)


class SuffixProposer:
    """Drafts for the engine's rows; one ``RequestDrafter`` per running request."""

    def __init__(self, config: SpeculativeConfig, store: DraftStore | None = None) -> None:
        self.config = config
        self.store = store if store is not None else DraftStore(
            config.store_tokens, ttl_s=config.store_ttl_s)
        self._requests: dict[str, RequestDrafter] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def start(self, request_id: str, prompt: list[int], tenant: str) -> None:
        """Follow a new request; ``tenant``'s stored texts are the only ones it drafts from."""
        cursor = StoreCursor(self.store, tenant, self.config.match_window)
        self._requests[request_id] = RequestDrafter(prompt, cursor)

    def observe(self, request_id: str, tokens: list[int]) -> None:
        self._requests[request_id].observe(tokens)

    def forget(self, request_id: str) -> None:
        """The request ended: its index goes (a no-op for one never started)."""
        self._requests.pop(request_id, None)

    def draft_length(self, match_length: int, limit: int) -> int:
        if match_length < self.config.min_match_tokens:
            return 0
        return min(limit, self.config.num_speculative_tokens,
                   math.floor(match_length * self.config.draft_per_matched))

    def propose(self, request_id: str, limit: int) -> Draft:
        """Up to ``limit`` draft tokens for the request (fewer for a weak match)."""
        drafter = self._requests[request_id]
        cap = min(limit, self.config.num_speculative_tokens)
        if cap <= 0:
            return NO_DRAFT
        own_length, own = drafter.own_match(cap)
        stored = drafter.cursor.best(cap)
        if stored.length > own_length and stored.continuation:
            length, tokens, source = stored.length, stored.continuation, "store"
        else:
            length, tokens, source = own_length, own, "own"
        count = self.draft_length(length, cap)
        if count == 0 or not tokens:
            return NO_DRAFT
        return Draft(tokens[:count], length, source)

    def finish(self, request_id: str, prompt_len: int) -> list[int]:
        """Forget the request; returns the text to store (its prompt's tail and output),
        already added to the local store under the request's tenant."""
        drafter = self._requests.pop(request_id, None)
        if drafter is None:
            return []
        tail = max(0, prompt_len - self.config.stored_prompt_tail)
        text = drafter.tokens[tail:]
        self.store.add(text, drafter.cursor.tenant)
        return text
