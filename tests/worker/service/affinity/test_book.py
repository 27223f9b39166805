"""The worker's affinity book and its board: an LRU mirror of the prefix cache in chunk
hashes, bounded by the cache's size, written to Redis with each beat, and the route
counts of what the intake pulled."""

from __future__ import annotations

import time
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from protocol.affinity.chunks import prefix_chunks
from protocol.keys import Keys
from protocol.models import GenerateRequest
from worker.service.affinity.board_writer import FULL_EVERY, BoardWriter
from worker.service.affinity.book import AffinityBook
from worker.service.metrics.affinity import AffinityMetrics
from worker.service.redis.connection import WorkerSettings


def _req(tag: str, chars: int = 2048) -> GenerateRequest:
    return GenerateRequest(prompt=(tag + " ") * (chars // (len(tag) + 1)))


def test_the_book_drops_the_least_recently_served_once_the_cache_is_full() -> None:
    a, b, c = _req("alpha"), _req("bravo"), _req("charlie")
    book = AffinityBook(capacity_tokens=1024)  # two 2,048-character prompts (512 tokens each)
    book.served(a)
    book.served(b)
    first = book.take()
    assert set(first.added) == set(prefix_chunks(a)) | set(prefix_chunks(b))
    book.served(a)  # a is used again: b is now the oldest
    book.served(c)
    changes = book.take()
    assert set(prefix_chunks(b)) <= changes.removed
    assert not changes.removed & (set(prefix_chunks(a)) | set(prefix_chunks(c)))
    full = book.take(full=True)
    assert set(full.added) == set(prefix_chunks(a)) | set(prefix_chunks(c))
    assert book.take().added == {} and len(book) == len(full.added)
    book.served(GenerateRequest(prompt="short"))  # no whole chunk: nothing to book
    assert book.take().added == {}


def test_the_board_follows_the_book_and_expires_with_the_heartbeat(redis_client: Any) -> None:
    r: redis.Redis = redis_client
    r.flushdb()
    settings = WorkerSettings(redis_url="redis://unused", worker_id="w-book")
    key = Keys().affinity("w-book")
    book = AffinityBook(capacity_tokens=1024)
    writer = BoardWriter(settings, book, AffinityMetrics(CollectorRegistry()))
    a, b = _req("alpha"), _req("bravo")
    book.served(a)
    writer.write(r)
    assert {m.decode() for m in r.zrange(key, 0, -1)} == set(prefix_chunks(a))
    assert 0 < r.pttl(key) <= round(settings.ttls.heartbeat_s * 1000)
    book.served(b)
    book.served(_req("charlie"))  # evicts a
    writer.write(r)
    held = {m.decode() for m in r.zrange(key, 0, -1)}
    assert not held & set(prefix_chunks(a)) and set(prefix_chunks(b)) <= held
    r.delete(key)  # the key expired during an outage: the next full write restores it
    for _ in range(FULL_EVERY - 1):
        writer.write(r)
    assert {m.decode() for m in r.zrange(key, 0, -1)} == held
    assert writer.heartbeat()["affinity_advertised"] == len(book)
    writer.remove(r)
    assert not r.exists(key)


def test_routes_are_counted_from_the_entry_fields() -> None:
    metrics = AffinityMetrics(CollectorRegistry())
    now = int(time.time() * 1000)
    assert metrics.pulled_entry({b"data": b"x"}, "w1") == "unmarked"
    assert metrics.pulled_entry({b"prefer": b"w1", b"marked": str(now).encode(),
                                 b"pulled": str(now + 5).encode()}, "w1") == "affinity"
    assert metrics.pulled_entry({b"prefer": b"w2", b"marked": str(now).encode(),
                                 b"pulled": str(now + 250).encode()}, "w1") == "stolen"
    assert metrics.heartbeat(7) == {"affinity_pulled": 1, "affinity_stolen": 1,
                                    "affinity_unmarked": 1, "affinity_advertised": 7}
    wait = metrics.wait.labels(route="stolen")
    assert wait._sum.get() == 0.25  # type: ignore[attr-defined]


def test_a_failing_board_write_never_stops_the_heartbeat(redis_client: Any) -> None:
    """The control thread logs a board write that fails (a bug, a refused command) and
    carries on; the writer's next write is a full one."""
    import queue

    from worker.service.redis.leases import HeldEntries
    from worker.service.sidecars.control import Control

    port = redis_client.connection_pool.connection_kwargs["port"]
    settings = WorkerSettings(redis_url=f"redis://127.0.0.1:{port}/0", worker_id="w-ctl")
    control = Control(settings, HeldEntries(), queue.Queue(), lambda: {})
    writer = BoardWriter(settings, AffinityBook(10_000), AffinityMetrics(CollectorRegistry()))
    writer.book.served(_req("alpha"))
    control._write_board(writer)  # the first write is a full one
    assert writer._beats == 1
    redis_client.set(writer.key, "a string: ZADD on it is refused")
    writer.book.served(_req("bravo"))
    control._write_board(writer)  # refused: logged, not raised
    assert writer._beats == 0
    control.beat()
    assert redis_client.exists(Keys().worker("w-ctl"))
