"""Dead letters are for entries no worker can run, and they are bounded.

A real ``ferry worker`` process against a real redis-server:

* requests cancelled while still queued (in their tenant's fair backlog) are dropped by the
  worker that pulls them: acknowledged, deleted, no dead letter, their one ``cancelled``
  event published once (by the cancel itself) and never again;
* the dead-letter stream is bounded by count, age and payload size: a big payload keeps
  its head and size, the reason and the ids; old and surplus records go.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from protocol.client import FerryClient
from protocol.codec import decode_event
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tenants import fair
from protocol.tenants.ids import DEFAULT_TENANT
from tests.worker.service.procs import Monitor, WorkerProcess, assert_contiguous

KEYS = Keys()


@pytest.fixture
def fresh(redis_server: Any, redis_client: redis.Redis) -> Iterator[redis.Redis]:
    redis_client.flushall()
    yield redis_client


def _dead(r: redis.Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return list(r.xrange(KEYS.dead_letter))


def test_cancelled_before_pull_is_dropped_without_a_dead_letter(
    fresh: redis.Redis, redis_server: Any, checkpoint: str, log_dir: Path
) -> None:
    """The issue's case: 10 queued requests with 100 KB prompts cancelled before any
    worker pulled them made 1 MB of dead letters ("duplicate request_id ... owned by
    another entry"); now they leave nothing behind, and their clients got exactly one
    terminal ``cancelled`` event each."""
    client = FerryClient.from_url(redis_server.url)
    client.ensure_group()
    monitor = Monitor(redis_server.url)
    monitor.start()
    params = SamplingParams(max_tokens=4, temperature=0)
    cancelled = [GenerateRequest(prompt="x" * 100_000, params=params) for _ in range(10)]
    for request in cancelled:  # no worker yet: each waits in the fair backlog
        client.enqueue(request)
        assert client.cancel(request.request_id, "client disconnected") == "cancelled"
    after = GenerateRequest(prompt="def a():", params=params)
    with WorkerProcess(checkpoint, redis_server.url, "dl1", log_dir) as worker:
        worker.wait_live()
        counter = _settled_counter(fresh)
        with client.subscribe(after.request_id) as sub:  # and the worker goes on serving
            client.enqueue(after)
            events = list(sub.events(timeout=60))
    monitor.stop()
    client.close()
    assert_contiguous(events)
    assert counter < 1000  # the 10 x 25000 tokens their pulls charged were given back
    assert _dead(fresh) == [], _dead(fresh)  # before the fix: 10 "duplicate" dead letters
    assert fresh.xlen(KEYS.requests) == 0  # acknowledged and deleted
    assert fresh.xpending(KEYS.requests, KEYS.group)["pending"] == 0
    assert fresh.xlen(fair.bell(KEYS.requests)) == 0
    for request in cancelled:
        rid = request.request_id
        log = [decode_event(x) for x in fresh.lrange(KEYS.events(rid), 0, -1)]
        assert [(e.seq, e.finish_reason) for e in log] == [(0, "cancelled")]
        assert monitor.seen[rid] == [0], rid  # published once, by the cancel
        assert fresh.hget(KEYS.job(rid), "state") == b"cancelled"


def _settled_counter(r: redis.Redis, timeout: float = 30.0) -> float:
    """The default tenant's virtual token counter on the normal lane once the worker has
    pulled every queued request and settled what it owes (each pull charged the prompt,
    about 25000 tokens here; a request dropped unserved used nothing)."""
    deadline = time.monotonic() + timeout
    while r.xlen(fair.bell(KEYS.requests)) and time.monotonic() < deadline:
        time.sleep(0.05)
    while True:
        counter = float(r.hget(fair.counters(KEYS.requests), DEFAULT_TENANT) or 0)
        if counter < 1000 or time.monotonic() > deadline:
            return counter
        time.sleep(0.1)


def _bad_entry(rid: str, pad: int) -> dict[str, bytes]:
    """A stream entry no worker can run (an unknown field) whose request id is readable."""
    payload = {"version": 1, "request_id": rid, "prompt": "p" * pad, "bogus": 1}
    return {"data": msgpack.packb(payload, use_bin_type=True)}


def _wait_dead(r: redis.Redis, reason_of: str, timeout: float = 60.0) -> dict[bytes, bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _id, fields in _dead(r):
            if fields.get(b"request_id") == reason_of.encode():
                return fields
        time.sleep(0.05)
    raise AssertionError(f"no dead letter for {reason_of}: {_dead(r)}")


def test_dead_letters_are_bounded_by_count_age_and_size(
    fresh: redis.Redis, redis_server: Any, checkpoint: str, log_dir: Path
) -> None:
    FerryClient.from_url(redis_server.url).ensure_group()
    fresh.xadd(KEYS.dead_letter, {"reason": "ancient"}, id="1000-0")  # long past 1 hour
    with WorkerProcess(checkpoint, redis_server.url, "dl2", log_dir,
                       "--dead-letter-max-len", "3", "--dead-letter-max-age-s", "3600",
                       "--dead-letter-max-payload-bytes", "1024") as worker:
        worker.wait_live()
        fresh.xadd(KEYS.requests, _bad_entry("big-1", 50_000))
        big = _wait_dead(fresh, "big-1")
        assert all(f.get(b"reason") != b"ancient" for _i, f in _dead(fresh))  # by age
        for i in range(4):
            fresh.xadd(KEYS.requests, _bad_entry(f"small-{i}", 10))
        _wait_dead(fresh, "small-3")
    assert b"data" not in big and len(big[b"data_head"]) == 1024  # by size
    assert int(big[b"data_bytes"]) > 50_000
    assert b"bogus" in big[b"reason"] and big[b"stream"] == KEYS.requests.encode()
    records = _dead(fresh)
    assert [f[b"request_id"] for _i, f in records] == [b"small-1", b"small-2", b"small-3"]
    assert all(b"data" in f for _i, f in records)  # small payloads are kept whole
