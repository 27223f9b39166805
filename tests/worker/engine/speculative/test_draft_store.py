"""The draft store per tenant and its retention: a text is offered to its own tenant only,
a tenant's flood evicts its own texts first, nothing is offered past the TTL and expired
segments are dropped; the TTL setting (``FERRY_SPEC_STORE_TTL_S``) and its bounds."""

from __future__ import annotations

import math

import pytest

from worker import EngineConfig
from worker.engine.speculative.config import DEFAULT_STORE_TTL_S, SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore, StoreCursor
from worker.engine.speculative.suffix_proposer import SuffixProposer

PROMPT, OUTPUT = list(range(100, 140)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


class Clock:
    """Wall-clock time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_text_is_offered_to_its_own_tenant_only() -> None:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=16)
    proposer = SuffixProposer(config)
    proposer.start("a::first", PROMPT, "a")
    proposer.observe("a::first", OUTPUT)
    proposer.finish("a::first", len(PROMPT))
    proposer.start("b::same", PROMPT, "b")
    assert proposer.propose("b::same", 16).source != "store"
    proposer.start("a::again", PROMPT, "a")
    draft = proposer.propose("a::again", 16)
    assert draft.source == "store" and draft.tokens == OUTPUT
    assert proposer.store.longest_match(PROMPT[-8:], 4, "b").length == 0
    assert proposer.store.tokens_of("a") > 0 == proposer.store.tokens_of("b")


def test_a_cursor_never_walks_another_tenants_segments() -> None:
    store = DraftStore(10_000, segment_tokens=50)
    for i in range(6):
        store.add([i] * 40, "flood")
    store.add([1, 2, 3, 4], "quiet")
    cursor = StoreCursor(store, "quiet")
    cursor.reset([1, 2, 3])
    assert cursor.best(2).continuation == [4]
    assert len(cursor._matches) == 1  # one segment followed: its own


def test_a_flood_evicts_its_own_texts_first() -> None:
    store = DraftStore(capacity_tokens=400, segment_tokens=100)
    store.add([5, 6, 7, 8], "quiet")
    for i in range(40):
        store.add([1000 + i] * 3 + list(range(i * 50, i * 50 + 60)), "flood")
        assert store.num_tokens <= 400 + 100
    assert store.longest_match([5, 6, 7], 1, "quiet").continuation == [8]
    assert store.longest_match([1039] * 3, 2, "flood").continuation == [1950, 1951]
    assert store.longest_match([1000] * 3, 2, "flood").length <= 1  # long gone
    assert store.num_tokens == store.tokens_of("quiet") + store.tokens_of("flood")


def test_nothing_is_offered_past_the_ttl() -> None:
    clock = Clock()
    store = DraftStore(10_000, ttl_s=800.0, clock=clock)
    store.add([1, 2, 3, 4], "a")
    clock.now += 50.0  # within a segment's span (ttl / 8): same segment
    store.add([5, 6, 7, 8], "a")
    assert store.num_segments == 1
    clock.now += 100.0  # past the span: a new segment
    store.add([9, 10, 11, 12], "a")
    assert store.num_segments == 2
    clock.now += 649.0  # the first segment's oldest text is 799 s old
    assert store.expire() == 0 and store.longest_match([2, 3], 1, "a").continuation == [4]
    clock.now += 1.0  # 800 s: the whole first segment goes, its younger text too
    assert store.expire() == 1
    assert store.longest_match([2, 3], 1, "a").length == 0
    assert store.longest_match([6, 7], 1, "a").length == 0
    assert store.longest_match([10, 11], 1, "a").continuation == [12]
    assert store.expired_segments == 1 and store.num_tokens == 4
    clock.now += 150.0
    assert store.expire() == 1 and store.num_tokens == 0 and store.tokens_of("a") == 0


def test_a_text_written_long_ago_is_not_stored() -> None:
    clock = Clock()
    store = DraftStore(10_000, ttl_s=60.0, clock=clock)
    assert not store.add([1, 2, 3], "a", created=clock.now - 60.0)
    assert store.add([1, 2, 3], "a", created=clock.now - 59.0)
    clock.now += 1.0
    assert store.expire() == 1 and store.num_tokens == 0  # expires by when it was written


def test_a_cursor_drops_an_expired_segment() -> None:
    clock = Clock()
    store = DraftStore(10_000, ttl_s=80.0, clock=clock)
    store.add([1, 2, 3, 4, 5], "a")
    cursor = StoreCursor(store, "a")
    cursor.reset([1, 2])
    assert cursor.best(3).continuation == [3, 4, 5]
    clock.now += 80.0
    store.expire()
    cursor.advance([3])
    assert cursor.best(3).length == 0 and not cursor._matches


def test_a_store_that_keeps_nothing() -> None:
    for store in (DraftStore(0), DraftStore(1000, ttl_s=0.0)):
        assert not store.add([1, 2, 3], "a") and store.num_tokens == 0
    assert not SpeculativeConfig("suffix", store_ttl_s=0).keeps_outputs
    assert not SpeculativeConfig("suffix", store_tokens=0).keeps_outputs
    assert SpeculativeConfig("suffix").keeps_outputs


def test_ttl_setting() -> None:
    assert SpeculativeConfig().store_ttl_s == DEFAULT_STORE_TTL_S == 6 * 3600
    cfg = EngineConfig.from_env("m", {"FERRY_SPECULATIVE": "suffix",
                                      "FERRY_SPEC_STORE_TTL_S": "90"})
    assert cfg.speculative.store_ttl_s == 90.0
    assert EngineConfig.from_env("m", {}).speculative.store_ttl_s == DEFAULT_STORE_TTL_S
    for bad in ("-1", "inf", "nan", "1e12", "six hours"):
        with pytest.raises(ValueError, match="FERRY_SPEC_STORE_TTL_S"):
            EngineConfig.from_env("m", {"FERRY_SPEC_STORE_TTL_S": bad})
    for value in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="store_ttl_s"):
            SpeculativeConfig(store_ttl_s=value)
