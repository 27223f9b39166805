"""The fair pull with preference marks, on a real redis-server: the preferred worker takes
its request at once, another only after the steal time, unmarked requests and the fair
order are as before, and the producer marks only a live worker holding the prefix."""

from __future__ import annotations

import time

import pytest
import redis

from protocol.affinity.board import queue_advertise
from protocol.affinity.chunks import prefix_chunks
from protocol.affinity.mark import mark, unmark
from protocol.affinity.router import AffinitySettings, Router
from protocol.client import FerryClient
from protocol.codec import decode_entry, encode_request
from protocol.keys import Keys
from protocol.models import GenerateRequest, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from protocol.tenants import fair

KEYS = Keys()
STREAM = KEYS.requests


def _push(r: redis.Redis, tenant: str, rid: str, prefix: bytes = b"") -> None:
    request = GenerateRequest(prompt="x" * 40, request_id=f"{tenant}::{rid}", tenant=tenant)
    keys, argv = fair.push_args(STREAM, request, 1.0, prefix + encode_request(request))
    r.execute_command("EVAL", fair.PUSH_LUA, len(keys), *keys, *argv)


def _ids(entries: list) -> list[str]:
    return [decode_entry(fields).request_id for _id, fields in entries]


@pytest.fixture()
def r(redis_client: redis.Redis) -> redis.Redis:
    redis_client.flushdb()
    ensure_group(redis_client, KEYS)
    return redis_client


def test_mark_round_trips_and_refuses_what_it_cannot_carry() -> None:
    body = encode_request(GenerateRequest(prompt="hi"))
    assert unmark(mark("w-1", 5, 9) + body) == ("w-1", 5, 9, body)
    assert unmark(body) == (None, 0, 0, body)
    for bad in ("", "a\nb", "w" * 300):
        with pytest.raises(ValueError, match="worker_id"):
            mark(bad, 1, 2)
    with pytest.raises(ValueError, match="times"):
        mark("w", 9, 5)


def test_the_preferred_worker_takes_its_request_others_only_after_the_steal_time(
        r: redis.Redis) -> None:
    now = int(time.time() * 1000)
    _push(r, "a", "held", mark("w-hold", now, now + 600))
    _push(r, "a", "plain")
    # another worker passes over the marked head and takes the unmarked one behind it
    got, _marks, soonest = fair.pull_marked(r, STREAM, KEYS.group, "w-other", 4)
    assert _ids(got) == ["a::plain"] and 0 < soonest <= 600
    assert b"prefer" not in got[0][1]
    got, _marks, soonest = fair.pull_marked(r, STREAM, KEYS.group, "w-other", 4)
    assert got == [] and 0 < soonest <= 600
    # the preferred worker takes it at once; the entry carries the request alone
    got, _marks, soonest = fair.pull_marked(r, STREAM, KEYS.group, "w-hold", 4)
    assert _ids(got) == ["a::held"] and soonest == -1
    assert got[0][1][b"prefer"] == b"w-hold" and int(got[0][1][b"marked"]) == now
    assert r.llen(fair.backlog(STREAM, "a")) == 0 and r.zcard(fair.ready(STREAM)) == 0
    # past the steal time, anyone takes it
    _push(r, "a", "late", mark("w-hold", now, now))
    got, _marks, _ = fair.pull_marked(r, STREAM, KEYS.group, "w-other", 4)
    assert _ids(got) == ["a::late"] and got[0][1][b"prefer"] == b"w-hold"


def test_fair_order_holds_among_what_a_worker_may_take(r: redis.Redis) -> None:
    now = int(time.time() * 1000)
    for i in range(3):
        _push(r, "a", f"m{i}", mark("w-a", now, now + 60_000))
    for i in range(3):
        _push(r, "b", f"p{i}")
        _push(r, "c", f"p{i}")
    # w-x may take only b's and c's: it alternates them as the counters say
    got, _, _ = fair.pull_marked(r, STREAM, KEYS.group, "w-x", 4)
    assert sorted(_ids(got)) == ["b::p0", "b::p1", "c::p0", "c::p1"]
    # w-a gets its own marked ones and the rest in counter order: a is lowest now
    got, _, _ = fair.pull_marked(r, STREAM, KEYS.group, "w-a", 10)
    assert _ids(got)[:3] == ["a::m0", "a::m1", "a::m2"] and len(got) == 5
    assert r.zcard(fair.ready(STREAM)) == 0


def _beat(r: redis.Redis, worker: str, **stats: int) -> None:
    pipe = r.pipeline()
    write_heartbeat(pipe, KEYS, WorkerHeartbeat(worker_id=worker, model="m", started_at=1.0,
                                                updated_at=time.time(), stats=dict(stats)),
                    Ttls())
    pipe.execute()


def _advertise(r: redis.Redis, worker: str, hashes: list[str]) -> None:
    pipe = r.pipeline()
    queue_advertise(pipe, KEYS.affinity(worker), dict.fromkeys(hashes, time.time()), [],
                    4000)
    pipe.execute()


def test_the_producer_marks_the_live_holder_of_the_longest_prefix(r: redis.Redis) -> None:
    convo = GenerateRequest(prompt="system prompt " * 80 + "turn two " * 40,
                            request_id="acme::t2", tenant="acme")
    hashes = prefix_chunks(convo)
    _beat(r, "w-short", queued=0, waiting=0)
    _beat(r, "w-long", queued=0, waiting=0)
    _advertise(r, "w-short", hashes[:2])
    _advertise(r, "w-long", hashes[:4])
    router = Router(KEYS, AffinitySettings(steal_ms=300, max_depth=2))
    who, marked, steal, _ = unmark(router.mark_for(r, convo))
    assert who == "w-long" and steal - marked == 300
    # marks since its last beat count toward its depth: the third goes to the other holder
    assert unmark(router.mark_for(r, convo))[0] == "w-long"
    assert unmark(router.mark_for(r, convo))[0] == "w-short"
    # another tenant's request with the same text holds nothing anywhere
    other = convo.model_copy(update={"tenant": "beta", "request_id": "beta::t2"})
    assert router.mark_for(r, other) == b""
    # a dead holder (no heartbeat) is never named; off means never marked
    r.delete(KEYS.worker("w-long"), KEYS.worker("w-short"))
    assert router.mark_for(r, convo) == b""
    assert Router(KEYS, AffinitySettings(enabled=False)).mark_for(r, convo) == b""


def test_the_client_enqueues_marked_requests_that_the_holder_pulls(r: redis.Redis) -> None:
    client = FerryClient(r, keys=KEYS, affinity=AffinitySettings(steal_ms=5_000))
    convo = GenerateRequest(prompt="shared context " * 100, request_id="t::1", tenant="t")
    _beat(r, "w-hold")
    _advertise(r, "w-hold", prefix_chunks(convo))
    client.enqueue(convo)
    assert fair.pull(r, STREAM, KEYS.group, "w-else", 4)[0] == []
    [(_, fields)], _ = fair.pull(r, STREAM, KEYS.group, "w-hold", 4)
    assert decode_entry(fields) == convo


def test_a_holder_is_skipped_only_when_much_deeper_than_the_least_busy() -> None:
    from protocol.affinity.board import Candidate, choose

    busy_holder = Candidate("a", matched=5, depth=9)
    assert choose([busy_holder, Candidate("b", 0, depth=8)], max_depth=8) == busy_holder
    assert choose([busy_holder, Candidate("b", 0, depth=0)], max_depth=8) is None
    assert choose([busy_holder, Candidate("b", 2, depth=0)], max_depth=8).worker_id == "b"
    assert choose([Candidate("a", 3, 0, draining=True)], max_depth=8) is None
    assert choose([Candidate("a", 3, 1), Candidate("b", 3, 0)], max_depth=8).worker_id == "b"


def test_a_shared_prefix_spreads_by_load_and_a_conversation_stays_with_its_holder() -> None:
    """Two workers hold a hot system prompt (14 chunks); one also holds this conversation's
    first turn (2 more). The conversation stays while the loads are close, and moves to
    the other holder of the hot prefix once its own holder runs 3 more requests; a
    conversation only one worker holds stays there under any load within the depth bound."""
    from protocol.affinity.board import Candidate, choose

    def pick(*cands: Candidate) -> str | None:
        best = choose(cands, max_depth=8, load_chunks=1.0)
        return best.worker_id if best else None

    assert pick(Candidate("a", 16, 0, running=5), Candidate("b", 14, 0, running=4)) == "a"
    assert pick(Candidate("a", 16, 0, running=7), Candidate("b", 14, 0, running=4)) == "b"
    assert pick(Candidate("a", 16, 0, running=12), Candidate("b", 0, 0, running=0)) == "a"
    # a worker that holds nothing is never chosen for its low load: the request is
    # offered to the holder, and the others take it after the steal time if it is slow
    assert pick(Candidate("a", 1, 0, running=3), Candidate("b", 0, 0, running=0)) == "a"
    # load_chunks=0: the longest prefix alone decides, as a pure prefix router
    assert choose([Candidate("a", 16, 0, running=30), Candidate("b", 14, 0)], max_depth=8,
                  load_chunks=0).worker_id == "a"
