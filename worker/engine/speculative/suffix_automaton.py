"""An online suffix automaton over token ids: the index behind suffix decoding's drafts.

A suffix automaton of a text has one state per class of substrings that end at the same
set of positions, at most ``2n`` states for ``n`` tokens, and is built one token at a time
in amortized constant time. Walking it with a context, and falling back along suffix links
on a miss, gives the *longest suffix of the context that occurs in the text* and one place
where it ends (``first_end``): the tokens after that place are the draft. That is exactly
what a suffix-decoding proposer asks, for a request's own tokens (extended as it decodes)
and for the store of past outputs, without a tree of every suffix.

Token ids are non-negative; ``SEPARATOR`` (-1) may be appended between unrelated texts so
no match runs across the seam.
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = -1


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in a text: its ``length`` in tokens and the
    index in the text of its last token (``end``), so ``tokens[end + 1:]`` follow it."""

    length: int
    end: int
    state: int = 0  # the automaton state holding the match


NO_MATCH = Match(0, -1)


class SuffixAutomaton:
    """Suffix automaton with each state's first end position; ``tokens`` is the text."""

    def __init__(self, track_recent: bool = False) -> None:
        self.tokens: list[int] = []
        # Per state: outgoing transitions, suffix link, longest length, first end index.
        self._next: list[dict[int, int]] = [{}]
        self._link: list[int] = [-1]
        self._len: list[int] = [0]
        self._first: list[int] = [-1]
        self._last = 0
        # With ``track_recent``: per state, its latest end index and the one before it
        # (``recent_match`` reads them), kept for the states near the text's end
        # (see ``_touch``).
        self._recent: list[int] | None = [-1] if track_recent else None
        self._before: list[int] = [-1] if track_recent else []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_states(self) -> int:
        return len(self._len)

    def extend(self, token: int) -> None:
        """Append ``token`` to the text (the classic online construction)."""
        nxt, link, length, first = self._next, self._link, self._len, self._first
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self._last] + 1)
        first.append(position)
        recent = self._recent
        if recent is not None:
            recent.append(position)
            self._before.append(-1)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                if recent is not None:
                    recent.append(recent[q])
                    self._before.append(self._before[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self._last = cur
        if recent is not None:
            self._touch(link[cur], position)

    def _touch(self, state: int, position: int, depth: int = 8) -> None:
        """The text's new end ``position`` is an end of every state on the new state's
        suffix path: record it as the latest for the first ``depth`` of them (the
        longest, which drafts use); a state further up keeps an older end, still a
        true occurrence, only not the latest."""
        recent, before, link = self._recent, self._before, self._link
        assert recent is not None
        while state > 0 and depth:
            if recent[state] != position:
                before[state] = recent[state]
                recent[state] = position
            state = link[state]
            depth -= 1

    def extend_all(self, tokens: list[int]) -> None:
        for token in tokens:
            self.extend(token)

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Extend a match (``state``, ``matched`` tokens long) by ``token``: the state and
        length of the longest suffix of (matched text + token) found in the text."""
        nxt, link, length = self._next, self._link, self._len
        # A state held across ``extend`` may have been split since (its shorter strings
        # moved to a clone, its suffix link): the match's state is the one on the suffix
        # path whose lengths cover ``matched``.
        while state > 0 and matched <= length[link[state]]:
            state = link[state]
        while state != -1 and token not in nxt[state]:
            state = link[state]
            if state != -1:
                matched = length[state]
        if state == -1:
            return 0, 0
        return nxt[state][token], matched + 1

    def longest_suffix(self, context: list[int]) -> Match:
        """The longest suffix of ``context`` that occurs in the text, and where its first
        occurrence ends."""
        state, matched = 0, 0
        for token in context:
            state, matched = self.step(state, matched, token)
        if matched == 0:
            return NO_MATCH
        return Match(matched, self._first[state], state)

    def first_end(self, state: int) -> int:
        return self._first[state]

    def recent_match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the text that also occurs earlier, at
        its latest earlier occurrence (``track_recent`` only): in a text that repeats
        itself the latest period is the best guess of the next (the model's loop as it
        is now, not as it first was). (0, -1) when no suffix occurs earlier."""
        assert self._recent is not None, "built without track_recent"
        state = self._link[self._last]
        if state <= 0:
            return 0, -1
        end = self._recent[state]
        if end == len(self.tokens) - 1:  # the text's own end: the one before it
            end = self._before[state]
        if end < 0:  # not reached here (the state was just touched): any occurrence
            end = self._first[state]
        return self._len[state], end

    def continuation(self, match: Match, limit: int) -> list[int]:
        """Up to ``limit`` tokens that follow ``match`` in the text, stopping at a
        separator."""
        out = self.tokens[match.end + 1:match.end + 1 + limit]
        if SEPARATOR in out:
            out = out[:out.index(SEPARATOR)]
        return out
