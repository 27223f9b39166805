"""``ferry/recovery.py`` on a real redis-server: a dead consumer's entries handed back so
a reaper takes them at once, its heartbeat dropped, its consumer pruned once empty."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from ferry.recovery import Recovery
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from tests.redis_server import RedisServer
from worker.service.redis.leases import HAND_BACK_IDLE_MS, hand_back_consumer

KEYS = Keys()
LEASE_MS = 30_000


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def r(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    client.flushall()
    yield client
    client.close()


def _deliver(r: redis.Redis, consumer: str, n: int) -> list[str]:
    for i in range(n):
        r.xadd(KEYS.requests, {"data": f"entry-{i}".encode()})
    reply = r.xreadgroup(KEYS.group, consumer, {KEYS.requests: ">"}, count=n)
    return [eid.decode() for eid, _fields in reply[0][1]]


def _beat(r: redis.Redis, worker_id: str) -> None:
    now = time.time()
    pipe = r.pipeline()
    write_heartbeat(pipe, KEYS, WorkerHeartbeat(worker_id=worker_id, model="m", started_at=now,
                                                updated_at=now), Ttls())
    pipe.execute()


def test_dead_worker_is_handed_back_dropped_and_pruned(server: RedisServer,
                                                       r: redis.Redis) -> None:
    ensure_group(r, KEYS)
    dead_ids, live_ids = _deliver(r, "up-1-0", 5), _deliver(r, "up-1-1", 2)
    _beat(r, "up-1-0")
    _beat(r, "up-1-1")
    recovery = Recovery(server.url, KEYS, "up-1")
    try:
        note = recovery.worker_died("up-1-0")
        assert note == "handed back 5 entries of up-1-0"
        assert not r.exists(KEYS.worker("up-1-0")) and r.exists(KEYS.worker("up-1-1"))
        assert r.smembers(KEYS.workers) == {b"up-1-1"}
        # a reaper with a 30 s lease takes exactly the dead worker's entries, right now
        _cursor, claimed, *_ = r.xautoclaim(KEYS.requests, KEYS.group, "up-1-1-r0",
                                            min_idle_time=LEASE_MS, count=100)
        assert sorted(eid.decode() for eid, _f in claimed) == sorted(dead_ids)
        consumers = {c["name"].decode() for c in r.xinfo_consumers(KEYS.requests, KEYS.group)}
        assert "up-1-0" in consumers
        recovery.tick()  # the dead consumer owns nothing now: pruned
        consumers = {c["name"].decode() for c in r.xinfo_consumers(KEYS.requests, KEYS.group)}
        assert consumers == {"up-1-1", "up-1-1-r0"}
        assert len(live_ids) == 2 and r.xpending(KEYS.requests, KEYS.group)["pending"] == 7
    finally:
        recovery.close()


def test_hand_back_pages_through_many_entries_and_only_the_named_consumer(
        r: redis.Redis) -> None:
    ensure_group(r, KEYS)
    dead, other = _deliver(r, "dead", 7), _deliver(r, "other", 3)
    assert hand_back_consumer(r, KEYS, "dead", page=2) == 7
    rows = r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 100)
    idle = {row["message_id"].decode(): row["time_since_delivered"] for row in rows}
    assert all(idle[e] >= HAND_BACK_IDLE_MS for e in dead)
    assert all(idle[e] < LEASE_MS for e in other)
    assert hand_back_consumer(r, KEYS, "nobody") == 0


def test_before_any_request_there_is_nothing_to_hand_back(server: RedisServer,
                                                          r: redis.Redis) -> None:
    recovery = Recovery(server.url, KEYS, "up-2")
    try:
        _beat(r, "up-2-0")
        note = recovery.worker_died("up-2-0")  # no stream, no group yet (NOGROUP)
        assert note is None  # nothing to say in the log line
        assert not r.exists(KEYS.worker("up-2-0"))
    finally:
        recovery.close()


def test_redis_away_is_a_note_not_a_crash() -> None:
    from tests.redis_server import free_port

    recovery = Recovery(f"redis://127.0.0.1:{free_port()}/0", KEYS, "up-3")
    try:
        note = recovery.worker_died("up-3-0")
        assert note is not None and "not handed back" in note and "after the lease" in note
        recovery.tick()  # nothing to prune, nothing raised
    finally:
        recovery.close()  # nothing raised either
