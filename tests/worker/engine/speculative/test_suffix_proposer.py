"""Suffix decoding's index and proposer: longest matches checked against brute force,
the own match's latest earlier occurrence and its loop, the bounded store, draft lengths;
the store per tenant (no text offered across tenants, a flood evicts its own first) and
its TTL (nothing offered past it, expired segments dropped)."""

from __future__ import annotations

import random

import pytest

from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore, StoreCursor
from worker.engine.speculative.suffix_automaton import SEPARATOR, SuffixAutomaton
from worker.engine.speculative.suffix_proposer import RequestDrafter, SuffixProposer, periodic

T = "t1"  # the tenant of these requests and texts


def brute_longest(text: list[int], context: list[int]) -> int:
    """Length of the longest suffix of context occurring in text (seams excluded)."""
    best = 0
    for n in range(1, len(context) + 1):
        pattern = context[-n:]
        if SEPARATOR in pattern:
            break
        if any(text[i:i + n] == pattern for i in range(len(text) - n + 1)):
            best = n
    return best


@pytest.mark.parametrize("alphabet", [2, 3, 7])
def test_longest_suffix_matches_brute_force(alphabet: int) -> None:
    rng = random.Random(alphabet)
    for _ in range(30):
        text = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        automaton = SuffixAutomaton()
        automaton.extend_all(text)
        assert automaton.num_states <= max(2, 2 * len(text))
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 12))]
        match = automaton.longest_suffix(context)
        assert match.length == brute_longest(text, context)
        if match.length:  # it really ends there
            start = match.end - match.length + 1
            assert text[start:match.end + 1] == context[-match.length:]


def test_running_match_points_at_an_earlier_occurrence() -> None:
    """The drafter's match is stepped before each token is indexed, through splits of the
    states it holds: its length equals the longest suffix found earlier in the text."""
    rng = random.Random(5)
    for _ in range(40):
        text = [rng.randrange(3) for _ in range(rng.randrange(2, 80))]
        drafter = RequestDrafter(text[:1], StoreCursor(DraftStore(0), T))
        for i in range(1, len(text)):
            drafter.observe([text[i]])
            length, follow = drafter.own_match(4)
            # longest suffix of text[:i+1] that also ends strictly before position i
            want = brute_longest(text[:i], text[:i + 1])
            assert length == want, (text[:i + 1], length, want)
            if length:
                assert follow and len(follow) <= 4


def test_recent_match_is_an_earlier_occurrence_and_the_latest_in_a_loop() -> None:
    """``recent_match``: the longest suffix found earlier (brute force) and a true earlier
    occurrence of it; in a text that loops, the occurrence one period back."""
    rng = random.Random(11)
    for _ in range(40):
        text = [rng.randrange(3) for _ in range(rng.randrange(2, 80))]
        automaton = SuffixAutomaton(track_recent=True)
        for i, token in enumerate(text):
            automaton.extend(token)
            length, end = automaton.recent_match()
            assert length == brute_longest(text[:i], text[:i + 1])
            if length:
                assert length - 1 <= end < i
                assert text[end - length + 1:end + 1] == text[i - length + 1:i + 1]
    loop = list(range(50, 60)) + [1, 2, 3, 4, 5] * 8  # a prefix, then a loop of period 5
    automaton = SuffixAutomaton(track_recent=True)
    for i, token in enumerate(loop):
        automaton.extend(token)
        length, end = automaton.recent_match()
        if i >= 15:  # one period in: the latest earlier occurrence ends a period back
            assert (length, end) == (i - 14, i - 5)


def test_own_drafts_run_on_around_a_loop() -> None:
    """A draft from the request's own loop does not stop where the text ends: the span
    after the latest earlier occurrence repeats (``periodic``)."""
    assert periodic([7, 1, 2, 3], 0, 7) == [1, 2, 3, 1, 2, 3, 1]
    assert periodic([7, 1, 2, 3], 3, 4) == []  # nothing follows the text's end
    assert periodic([7, 1, 2, 3], 1, 1) == [2]
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", store_tokens=0,
                                                draft_per_matched=4))
    proposer.start("r", [9, 8, 1, 2, 3, 1, 2, 3, 1, 2], T)
    draft = proposer.propose("r", limit=10)
    assert draft.source == "own" and draft.match_length == 5
    assert draft.tokens == [3, 1, 2, 3, 1, 2, 3, 1, 2, 3]


def test_repeated_span_is_drafted_from_the_request_itself() -> None:
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=8,
                                                store_tokens=0))
    span = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    proposer.start("r", [1, 2] + span + [3, 4], T)
    proposer.observe("r", [11, 12, 13])  # the output starts repeating the prompt's span
    draft = proposer.propose("r", limit=8)
    assert draft.source == "own" and draft.tokens == [14, 15, 16]  # 3 matched -> 3
    proposer.observe("r", [14, 15, 16, 17])
    # 7 matched -> 7 drafted, running on into the text decoded so far
    assert proposer.propose("r", limit=8).tokens == [18, 19, 20, 3, 4, 11, 12]
    assert proposer.propose("r", limit=2).tokens == [18, 19]


def test_weak_match_drafts_nothing() -> None:
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", min_match_tokens=3,
                                                store_tokens=0))
    proposer.start("r", [1, 2, 3, 9, 2, 3], T)
    assert proposer.propose("r", limit=16).tokens == []  # "2 3" matched: 2 < 3
    proposer.observe("r", [4])
    assert proposer.propose("r", limit=16).tokens == []  # nothing matches "... 4"


def test_a_retry_is_drafted_from_the_store() -> None:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=16)
    proposer = SuffixProposer(config)
    prompt, output = list(range(100, 140)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    proposer.start("first", prompt, T)
    proposer.observe("first", output)
    stored = proposer.finish("first", len(prompt))
    assert stored == prompt[-config.stored_prompt_tail:] + output
    proposer.start("retry", prompt, T)
    draft = proposer.propose("retry", limit=16)
    assert draft.source == "store" and draft.tokens == output
    proposer.observe("retry", output[:4])
    assert proposer.propose("retry", limit=3).tokens == output[4:7]


def test_store_is_bounded_and_drops_the_oldest() -> None:
    store = DraftStore(capacity_tokens=300, segment_tokens=100)
    for i in range(20):
        store.add([1000 + i] * 5 + list(range(i * 50, i * 50 + 40)), T)
        assert store.num_tokens <= 300 + 100
    assert store.num_segments <= 4
    assert store.longest_match([1019, 1019, 1019, 1019, 1019], 3, T).continuation == \
        [950, 951, 952]
    assert store.longest_match([1000] * 5, 3, T).length <= 1  # long gone
    assert store.texts_added == 20


def test_no_match_across_a_seam() -> None:
    store = DraftStore(capacity_tokens=1000)
    store.add([1, 2, 3], T)
    store.add([4, 5, 6], T)
    match = store.longest_match([2, 3], 4, T)
    assert match.length == 2 and match.continuation == []  # [-1] seam stops it
    assert store.longest_match([3, 4], 4, T).length == 1


def test_zero_capacity_store_keeps_nothing() -> None:
    store = DraftStore(capacity_tokens=0)
    store.add([1, 2, 3], T)
    assert store.num_tokens == 0 and store.longest_match([1, 2], 2, T).length == 0


@pytest.mark.parametrize("kwargs", [dict(method="ngram"), dict(num_speculative_tokens=0),
                                    dict(num_speculative_tokens=65),
                                    dict(min_match_tokens=0), dict(store_tokens=-1),
                                    dict(draft_per_matched=0)])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SpeculativeConfig(**kwargs)


def test_store_cursor_follows_the_store_as_it_grows() -> None:
    """A cursor's running matches equal a fresh walk of the window, through texts added
    (states split) and segments dropped while the request decodes."""
    rng = random.Random(9)
    store = DraftStore(capacity_tokens=120, segment_tokens=40)
    proposer = SuffixProposer(SpeculativeConfig(method="suffix", store_tokens=120), store)
    context = [rng.randrange(4) for _ in range(10)]
    proposer.start("r", context, T)
    for _ in range(60):
        store.add([rng.randrange(4) for _ in range(rng.randrange(1, 12))], T)
        token = rng.randrange(4)
        context.append(token)
        proposer.observe("r", [token])
        cursor_best = proposer._requests["r"].cursor.best(4)
        fresh = store.longest_match(context, 4, T)
        assert cursor_best.length == fresh.length, (cursor_best, fresh)
