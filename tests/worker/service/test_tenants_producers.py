"""Direct Redis producers, with and without a tenant, against a real ``ferry worker``.

* a producer of protocol version 4 names its tenant and writes the scoped id;
* an older producer XADDs straight into a lane stream (with or without the old enqueue
  script's job hash naming its entry): its requests are adopted as the default tenant's
  and served in turn, never dead-lettered as duplicates, even behind another tenant's
  backlog;
* a message naming a tenant with an id outside its namespace is dead-lettered, named.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import redis
from pydantic import ValidationError

from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.store import ensure_group
from protocol.tenants.ids import scoped_id
from tests.redis_server import RedisServer
from tests.worker.service.procs import WorkerProcess, start_all
from worker.models import default_model_path

KEYS = Keys()
PARAMS = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _old_message(rid: str, version: int = 3) -> bytes:
    return msgpack.packb({"version": version, "request_id": rid, "prompt": f"old {rid}",
                          "params": PARAMS}, use_bin_type=True)


def _state(r: redis.Redis, rid: str) -> tuple[str, float]:
    state, finished = r.hmget(KEYS.job(rid), "state", "finished_at")
    return (state or b"").decode(), float(finished or "inf")


def _wait(r: redis.Redis, ids: list[str], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_state(r, rid)[0] == "done" for rid in ids):
        assert time.monotonic() < deadline, {rid: _state(r, rid) for rid in ids}
        time.sleep(0.1)


def test_producers_with_and_without_a_tenant(redis_server: RedisServer,
                                             log_dir: Path) -> None:
    r = redis_server.client()
    ensure_group(r, KEYS)
    client = FerryClient(redis.Redis.from_url(redis_server.url))
    params = SamplingParams(**PARAMS)  # type: ignore[arg-type]
    backlog = [GenerateRequest(request_id=scoped_id("t1", f"q{i}"), tenant="t1",
                               prompt=f"tenant one, question {i}", params=params)
               for i in range(24)]
    for request in backlog:
        client.enqueue(request)
    # version 3, straight into the normal lane: no job hash at all
    r.xadd(KEYS.requests, {"data": _old_message("old-plain")})
    # version 3 with the old enqueue script's job hash naming the entry it XADDed
    entry = r.xadd(KEYS.requests, {"data": _old_message("old-scripted")})
    r.hset(KEYS.job("old-scripted"), mapping={"request_id": "old-scripted", "state": "queued",
                                              "entry_id": entry, "stream": KEYS.requests})
    # a tenant's message whose id is outside its namespace
    bad = msgpack.packb({"version": 4, "request_id": "plain", "tenant": "t1", "prompt": "x"},
                        use_bin_type=True)
    r.xadd(KEYS.requests, {"data": bad})
    with WorkerProcess(default_model_path(), redis_server.url, "w1", log_dir,
                       "--max-num-seqs", "4") as worker:
        start_all(worker)
        _wait(r, ["old-plain", "old-scripted", *(q.request_id for q in backlog)])
    dead = r.xrange(KEYS.dead_letter)
    assert len(dead) == 1 and b"request_id" in dead[0][1][b"reason"]
    assert b"namespace" in dead[0][1][b"reason"]
    # the default tenant took its turn among t1's 24: not after all of them
    last_old = max(_state(r, rid)[1] for rid in ("old-plain", "old-scripted"))
    t1_finished = sorted(_state(r, q.request_id)[1] for q in backlog)
    assert last_old < t1_finished[-4], sum(t < last_old for t in t1_finished)
    assert r.hget(KEYS.job("old-scripted"), "worker_id") == b"w1"
    assert not r.exists(KEYS.job("q0"))  # t1's ids live under its namespace only


def test_a_tenants_request_must_carry_its_scoped_id() -> None:
    with pytest.raises(ValidationError, match="namespace"):
        GenerateRequest(request_id="q0", tenant="t1", prompt="x")
    with pytest.raises(ValidationError, match="namespace"):
        GenerateRequest(request_id="t1::q0", prompt="x")  # no tenant: the default's ids
    with pytest.raises(ValidationError, match="tenant"):
        GenerateRequest(request_id="a b::q0", tenant="a b", prompt="x")
    with pytest.raises(ValueError, match="must not contain"):
        scoped_id("t1", "x::y")
    assert GenerateRequest(request_id="t1::q0", tenant="t1", prompt="x").tenant == "t1"
