"""The fleet's draft store against a real redis-server: one worker's outputs reach
another's store, also a worker started later, under their tenant only; the stream stays
capped; its own entries, bad entries and entries without a tenant are skipped; entries
older than the TTL are trimmed from the stream (on append and with nothing to append) and
never offered; a backlog keeps its newest texts; a Redis restart is survived, and appends
while Redis is away are lost, never raised."""

from __future__ import annotations

import time
from typing import Any

from tests.redis_server import free_port
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore
from worker.engine.speculative.suffix_proposer import SuffixProposer
from worker.service.redis.connection import WorkerSettings
from worker.service.sidecars.draft_feed import DraftFeed, pack_tokens, unpack_tokens

TTL_S = 3600.0


def _feed(url: str, worker: str, ttl_s: float = TTL_S, **kw: Any) -> DraftFeed:
    settings = WorkerSettings(redis_url=url, worker_id=worker, model_name="m")
    feed = DraftFeed(settings, worker, ttl_s, **kw)
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
        writer.start("a", prompt, "t1")
        writer.observe("a", output)
        first.publish(writer.finish("a", len(prompt)), "t1")
        assert first.flush() and first.published == 1
        reader = SuffixProposer(config)
        _drain_until(other, reader.store, 1)
        reader.start("retry", prompt, "t1")  # a retry on the second worker
        draft = reader.propose("retry", 16)
        assert draft.source == "store" and draft.tokens == output
        assert draft.match_length >= 4
        late = _feed(redis_server.url, "w3")  # started after the output was written
        try:
            late_store = DraftStore(10_000)
            _drain_until(late, late_store, 1)
            assert late_store.longest_match(prompt[-6:], 3, "t1").continuation == \
                output[:3]
        finally:
            late.stop()
        time.sleep(0.3)
        first.drain(own := DraftStore(10_000))
        assert own.texts_added == 0  # its own entry is not read back
    finally:
        first.stop()
        other.stop()


def test_an_entry_is_offered_to_its_own_tenant_only(redis_server: Any,
                                                   redis_client: Any) -> None:
    """Tenant alice's output, published by one worker, is filed under alice on another:
    alice's retry drafts from it, bob's identical request does not. Entries naming no
    tenant, or no valid one, are nobody's and are skipped."""
    first = _feed(redis_server.url, "t-w1")
    second = _feed(redis_server.url, "t-w2")
    try:
        config = SpeculativeConfig(method="suffix")
        writer = SuffixProposer(config)
        prompt, output = list(range(600, 640)), [19, 18, 17, 16, 15, 14, 13, 12]
        writer.start("alice::a", prompt, "alice")
        writer.observe("alice::a", output)
        for fields in ({"t": pack_tokens(prompt + [1, 2, 3])},  # an older writer's
                       {"t": pack_tokens(prompt + [4, 5, 6]), "tenant": "bob::x"},
                       {"t": pack_tokens(prompt + [7, 8, 9]), "tenant": ""}):
            redis_client.xadd(first.key, {**fields, "w": b"forged"})
        first.publish(writer.finish("alice::a", len(prompt)), "alice")
        assert first.flush() and first.published == 1
        tagged = [f for _, f in redis_client.xrange(first.key) if f.get(b"w") == b"t-w1"]
        assert [f[b"tenant"] for f in tagged] == [b"alice"]  # every entry carries its tenant
        reader = SuffixProposer(config)
        _drain_until(second, reader.store, 1)
        assert second.skipped == 3 and reader.store.texts_added == 1
        reader.start("bob::same", prompt, "bob")
        assert reader.propose("bob::same", 16).source != "store"
        assert reader.store.tokens_of("bob") == 0
        reader.start("alice::again", prompt, "alice")
        draft = reader.propose("alice::again", 16)
        assert draft.source == "store" and draft.tokens == output
    finally:
        first.stop()
        second.stop()


def test_entries_past_the_ttl_are_trimmed_and_never_offered(redis_server: Any,
                                                            redis_client: Any) -> None:
    """An entry older than the TTL is skipped by a reader and trimmed by the next append
    (which sets the key to expire a TTL later); one younger is filed with the time it was
    written, so the local store drops it when it would have expired in the stream."""
    ttl = 30.0
    key = WorkerSettings(redis_url=redis_server.url, model_name="m").keys.drafts("m")
    redis_client.delete(key)
    now_ms = int(time.time() * 1000)
    for age_s, tokens in ((ttl + 5, [1, 2, 3, 4]), (ttl - 10, [5, 6, 7, 8])):
        redis_client.xadd(key, {"t": pack_tokens(tokens), "tenant": "a", "w": b"other"},
                          id=f"{now_ms - int(age_s * 1000)}-0")
    reader = _feed(redis_server.url, "ttl-reader", ttl_s=ttl)
    writer = None
    try:
        store = DraftStore(10_000, ttl_s=ttl)
        _drain_until(reader, store, 1)
        # the old entry is skipped as expired, or trimmed first by the feed's own writer
        # (which trims as it starts): either way it is never received
        assert reader.expired in (0, 1) and reader.received == 1
        assert store.longest_match([1, 2, 3], 1, "a").length == 0  # never offered
        assert store.longest_match([5, 6, 7], 1, "a").continuation == [8]
        assert store.expire(time.time() + 10.5) == 1  # it was 20 s old when filed
        writer = _feed(redis_server.url, "ttl-writer", ttl_s=ttl)  # it trims as it starts
        writer.publish([9, 10, 11], "a")
        assert writer.flush() and writer.published == 1
        ages = [now_ms - int(entry_id.split(b"-")[0]) for entry_id, _ in
                redis_client.xrange(key)]
        assert len(ages) == 2 and max(ages) < ttl * 1000  # the old entry is gone
        assert 0 < redis_client.pttl(key) <= ttl * 1000
    finally:
        reader.stop()
        if writer is not None:
            writer.stop()


def test_the_stream_is_trimmed_with_nothing_to_append(redis_server: Any,
                                                      redis_client: Any) -> None:
    """No worker appends for a while: the writers' periodic trim still removes every entry
    older than the TTL, so no entry outlives it by more than the trim period."""
    key = WorkerSettings(redis_url=redis_server.url, model_name="m").keys.drafts("m")
    redis_client.delete(key)
    redis_client.xadd(key, {"t": pack_tokens([1, 2]), "tenant": "a", "w": b"other"})
    idle = _feed(redis_server.url, "idle", ttl_s=1.0, trim_every_s=0.2)
    try:
        deadline = time.monotonic() + 30
        while redis_client.xlen(key) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert redis_client.xlen(key) == 0 and idle.published == 0
    finally:
        idle.stop()


def test_stream_is_capped_and_bad_entries_skipped(redis_server: Any,
                                                   redis_client: Any) -> None:
    feed = _feed(redis_server.url, "cap", max_entries=100)
    reader = _feed(redis_server.url, "cap-reader")
    try:
        key = feed.key
        redis_client.xadd(key, {"t": b"\x01\x02\x03", "tenant": "t", "w": b"x"})  # not int32s
        for i in range(1000):
            feed.publish([i, i + 1, i + 2], "t")  # queued: the writer thread sends them
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
        writer.publish([1, 2, 3], "t")  # may be lost while the writer reconnects: a cache
        store = DraftStore(10_000)
        deadline = time.monotonic() + 20
        while store.texts_added == 0 and time.monotonic() < deadline:
            writer.publish([4, 5, 6], "t")
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
        redis_client.xadd(key, {"t": pack_tokens([i, i, i]), "tenant": "t", "w": b"other"})
    late = _feed(redis_server.url, "behind", max_pending=10)
    try:
        deadline = time.monotonic() + 10
        while late.received < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        store = DraftStore(10_000)
        assert late.drain(store, limit=100) == 10 and late.dropped == 40
        assert store.longest_match([49, 49, 49], 1, "t").length == 3
        assert store.longest_match([5, 5, 5], 1, "t").length < 3
    finally:
        late.stop()


def test_appends_while_redis_is_away_are_lost_not_raised() -> None:
    """No Redis at all: ``publish`` (the engine thread's side) still returns at once and
    the writer thread counts each append as lost and carries on."""
    feed = _feed(f"redis://127.0.0.1:{free_port()}/0", "away")
    try:
        started = time.monotonic()
        for i in range(5):
            feed.publish([i, i + 1], "t")
        assert time.monotonic() - started < 0.1
        assert feed.flush(timeout=30)
        assert (feed.published, feed.lost) == (0, 5)
        assert feed._writer.is_alive()  # still appending what comes next
    finally:
        feed.stop()


def test_the_worker_acl_user_appends_trims_and_reads(tmp_path: Any) -> None:
    """``ops/redis/users.acl``: the ``ferry-worker`` role may append to, trim, expire and
    read the draft stream, and nothing refused is raised on the writer thread."""
    from tests.ops.redis_acl.acl_server import AclRedis

    server = AclRedis(tmp_path)
    writer = reader = None
    try:
        writer = _feed(server.url("ferry-worker"), "acl-w")
        reader = _feed(server.url("ferry-worker"), "acl-r")
        writer.publish([1, 2, 3, 4], "a")
        assert writer.flush() and (writer.published, writer.lost) == (1, 0)
        store = DraftStore(10_000)
        _drain_until(reader, store, 1)
        assert 0 < server.client("ferry-admin").pttl(writer.key) <= TTL_S * 1000
    finally:
        for feed in (writer, reader):
            if feed is not None:
                feed.stop()
        server.stop()
