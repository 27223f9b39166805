"""The fleet's draft store (#29.2) against a real redis-server: one worker's outputs reach
another's store, also a worker started later; the stream stays capped; its own entries and
bad entries are skipped; a backlog keeps its newest texts; a Redis restart is survived,
and appends while Redis is away are lost, never raised."""

from __future__ import annotations

import time
from typing import Any

from tests.redis_server import free_port
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore
from worker.engine.speculative.suffix_proposer import SuffixProposer
from worker.service.draft_feed import DraftFeed, pack_tokens, unpack_tokens
from worker.service.redis_io import WorkerSettings


def _feed(url: str, worker: str, **kw: Any) -> DraftFeed:
    settings = WorkerSettings(redis_url=url, worker_id=worker, model_name="m")
    feed = DraftFeed(settings, worker, **kw)
    feed.start()
    return feed


def _drain_until(feed: DraftFeed, store: DraftStore, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while store.texts_added < count and time.monotonic() < deadline:
        feed.drain(store)
        time.sleep(0.02)
    assert store.texts_added >= count, (store.texts_added, count)


def test_pack_roundtrip() -> None:
    assert unpack_tokens(pack_tokens([0, 5, 2**31 - 1])) == [0, 5, 2**31 - 1]


def test_outputs_reach_other_workers_also_started_later(redis_server: Any) -> None:
    first = _feed(redis_server.url, "w1")
    other = _feed(redis_server.url, "w2")
    try:
        config = SpeculativeConfig(method="suffix")
        writer = SuffixProposer(config)
        prompt, output = list(range(500, 540)), [9, 8, 7, 6, 5, 4, 3, 2]
        writer.start("a", prompt)
        writer.observe("a", output)
        first.publish(writer.finish("a", len(prompt)))
        assert first.flush() and first.published == 1
        reader = SuffixProposer(config)
        _drain_until(other, reader.store, 1)
        reader.start("retry", prompt)  # a retry on the second worker
        draft = reader.propose("retry", 16)
        assert draft.source == "store" and draft.tokens == output
        assert draft.match_length >= 4
        late = _feed(redis_server.url, "w3")  # started after the output was written
        try:
            late_store = DraftStore(10_000)
            _drain_until(late, late_store, 1)
            assert late_store.longest_match(prompt[-6:], 3).continuation == output[:3]
        finally:
            late.stop()
        time.sleep(0.3)
        first.drain(own := DraftStore(10_000))
        assert own.texts_added == 0  # its own entry is not read back
    finally:
        first.stop()
        other.stop()


def test_stream_is_capped_and_bad_entries_skipped(redis_server: Any,
                                                   redis_client: Any) -> None:
    feed = _feed(redis_server.url, "cap", max_entries=100)
    reader = _feed(redis_server.url, "cap-reader")
    try:
        key = feed.key
        redis_client.xadd(key, {"t": b"\x01\x02\x03", "w": b"x"})  # not int32s
        for i in range(1000):
            feed.publish([i, i + 1, i + 2])  # queued: the writer thread sends them
        assert feed.flush() and feed.published + feed.lost == 1000
        assert redis_client.xlen(key) < 300  # MAXLEN ~ 100 (trimmed by whole nodes)
        store = DraftStore(1_000_000)
        deadline = time.monotonic() + 10
        while reader.received < min(redis_client.xlen(key), 100) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        reader.drain(store, limit=10_000)
        assert store.texts_added == reader.received > 0
    finally:
        feed.stop()
        reader.stop()


def test_redis_restart_is_survived(redis_server: Any) -> None:
    writer = _feed(redis_server.url, "rw")
    reader = _feed(redis_server.url, "rr")
    try:
        redis_server.restart()
        writer.publish([1, 2, 3])  # may be lost while the writer reconnects: a cache
        store = DraftStore(10_000)
        deadline = time.monotonic() + 20
        while store.texts_added == 0 and time.monotonic() < deadline:
            writer.publish([4, 5, 6])
            reader.drain(store)
            time.sleep(0.2)
        assert store.texts_added >= 1
    finally:
        writer.stop()
        reader.stop()


def test_a_backlog_keeps_the_newest_texts(redis_server: Any, redis_client: Any) -> None:
    """A worker starting behind a long stream (its queue smaller than the backlog) keeps
    the newest outputs, the ones most likely asked again, not the oldest."""
    key = WorkerSettings(redis_url=redis_server.url, model_name="m").keys.drafts("m")
    redis_client.delete(key)
    for i in range(50):
        redis_client.xadd(key, {"t": pack_tokens([i, i, i]), "w": b"other"})
    late = _feed(redis_server.url, "behind", max_pending=10)
    try:
        deadline = time.monotonic() + 10
        while late.received < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        store = DraftStore(10_000)
        assert late.drain(store, limit=100) == 10 and late.dropped == 40
        assert store.longest_match([49, 49, 49], 1).length == 3
        assert store.longest_match([5, 5, 5], 1).length < 3
    finally:
        late.stop()


def test_appends_while_redis_is_away_are_lost_not_raised() -> None:
    """No Redis at all: ``publish`` (the engine thread's side) still returns at once and
    the writer thread counts each append as lost and carries on."""
    feed = _feed(f"redis://127.0.0.1:{free_port()}/0", "away")
    try:
        started = time.monotonic()
        for i in range(5):
            feed.publish([i, i + 1])
        assert time.monotonic() - started < 0.1
        assert feed.flush(timeout=30)
        assert (feed.published, feed.lost) == (0, 5)
        assert feed._writer.is_alive()  # still appending what comes next
    finally:
        feed.stop()
