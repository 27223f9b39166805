"""The sync client against a real redis-server, with a test thread playing the worker."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from protocol.client import FerryClient
from protocol.codec import decode_cancel, encode_event
from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent, Usage
from protocol.store import DuplicateRequestError, Ttls, ensure_group, push_event, start_job
from protocol.streaming import StreamTimeout
from protocol.tenants import fair
from protocol.tenants.ids import DEFAULT_TENANT
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
TTLS = Ttls()


def _event(seq: int, final: bool = False, rid: str = "r1") -> TokenEvent:
    return TokenEvent(
        request_id=rid, seq=seq, token_ids=[100 + seq], text=f"t{seq} ",
        finish_reason="stop" if final else None, usage=Usage() if final else None,
    )


def _push(r: redis.Redis, *events: TokenEvent) -> None:
    pipe = r.pipeline()
    for event in events:
        push_event(pipe, KEYS, event, TTLS)
    pipe.execute()


def _later(delay: float, fn: object, *args: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn(*args)  # type: ignore[operator]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def client(redis_client: redis.Redis) -> FerryClient:
    return FerryClient(redis_client, poll_interval_s=30.0)  # no idle polling unless asked


def test_replay_then_live_in_order_without_duplicates(
    client: FerryClient, redis_client: redis.Redis
) -> None:
    _push(redis_client, _event(0), _event(1), _event(2))  # before anyone subscribed
    with client.subscribe("r1") as sub:

        def publish_rest() -> None:
            _push(redis_client, _event(3))
            redis_client.publish(KEYS.tokens("r1"), encode_event(_event(2)))  # duplicate
            _push(redis_client, _event(4))
            redis_client.publish(KEYS.tokens("r1"), encode_event(_event(3)))  # duplicate
            _push(redis_client, _event(5, final=True))
            _push(redis_client, _event(6))  # after the terminal event: ignored

        thread = _later(0.1, publish_rest)
        events = list(sub.events(timeout=10))
        thread.join()
    assert [e.seq for e in events] == [0, 1, 2, 3, 4, 5]
    assert "".join(e.text for e in events) == "t0 t1 t2 t3 t4 t5 "
    assert events[-1].finish_reason == "stop"


def test_gap_is_filled_from_the_replay_log(client: FerryClient, redis_client: redis.Redis) -> None:
    with client.subscribe("r1") as sub:
        assert sub.next_events(0.05) == []

        def publish_with_a_lost_message() -> None:
            _push(redis_client, _event(0))
            redis_client.rpush(KEYS.events("r1"), encode_event(_event(1)))  # never published
            _push(redis_client, _event(2, final=True))

        thread = _later(0.1, publish_with_a_lost_message)
        events = list(sub.events(timeout=10))
        thread.join()
    assert [e.seq for e in events] == [0, 1, 2]


def test_lost_terminal_event_is_found_by_idle_polling(redis_client: redis.Redis) -> None:
    client = FerryClient(redis_client, poll_interval_s=0.1)
    with client.subscribe("r1") as sub:
        _push(redis_client, _event(0))
        redis_client.rpush(KEYS.events("r1"), encode_event(_event(1, final=True)))
        assert [e.seq for e in sub.events(timeout=5)] == [0, 1]


def test_stream_resumes_after_seq_and_times_out(
    client: FerryClient, redis_client: redis.Redis
) -> None:
    _push(redis_client, *(_event(i) for i in range(4)), _event(4, final=True))
    assert [e.seq for e in client.stream("r1", after_seq=2)] == [3, 4]
    with pytest.raises(StreamTimeout):
        list(client.stream("nobody", timeout=0.3))


def test_generate_and_result_with_a_worker(
    client: FerryClient, redis_server: RedisServer
) -> None:
    with FakeWorker(redis_server.url, Script(tokens=["a", "b", "c"])) as worker:
        request = GenerateRequest(prompt="hi", model="fake-model")
        status = client.generate(request, timeout=10)
    assert status.state == "done" and status.text == "abc" and status.token_ids == [1, 2, 3]
    assert status.usage is not None and status.usage.completion_tokens == 3
    assert worker.seen == [request]
    stored = client.result(request.request_id)
    assert stored is not None and stored.state == "done" and stored.text == "abc"
    assert stored.worker_id == "fake-worker" and stored.model == "fake-model"
    assert client.result("unknown") is None
    pending = redis_server.client().xpending(KEYS.requests, KEYS.group)
    assert pending["pending"] == 0  # acknowledged


def test_enqueue_marks_queued_and_refuses_a_reused_id(
    client: FerryClient, redis_client: redis.Redis
) -> None:
    request = GenerateRequest(prompt="x", request_id="dup-1")
    assert client.enqueue(request) == "dup-1"
    status = client.result("dup-1")
    assert status is not None and status.state == "queued"
    waiting = fair.backlog(KEYS.requests, DEFAULT_TENANT)
    assert redis_client.llen(waiting) == 1 and redis_client.xlen(fair.bell(KEYS.requests)) == 1
    with pytest.raises(DuplicateRequestError, match="request_id"):
        client.enqueue(request)
    assert redis_client.llen(waiting) == 1


def test_cancel_queued_finishes_it_at_once(client: FerryClient, redis_client: redis.Redis) -> None:
    control = redis_client.pubsub()
    control.subscribe(KEYS.control)
    assert control.get_message(timeout=1)["type"] == "subscribe"
    client.enqueue(GenerateRequest(prompt="x", request_id="c1"))
    with client.subscribe("c1") as sub:
        assert client.cancel("c1", reason="changed my mind") == "cancelled"
        events = list(sub.events(timeout=5))
    assert [(e.seq, e.finish_reason) for e in events] == [(0, "cancelled")]
    assert redis_client.get(KEYS.cancelled("c1")) == b"changed my mind"
    assert 0 < redis_client.ttl(KEYS.cancelled("c1")) <= TTLS.cancelled_s
    message = control.get_message(timeout=2)
    assert message is not None and decode_cancel(message["data"]).request_id == "c1"
    status = client.result("c1")
    assert status is not None and status.state == "cancelled"
    assert status.finish_reason == "cancelled"
    control.close()


def test_cancelled_before_pull_is_skipped_not_a_duplicate(
    client: FerryClient, redis_client: redis.Redis
) -> None:
    """A request cancelled in its fair backlog is still pulled; START_JOB tells its worker
    to acknowledge and drop it ('skip'), not to dead-letter it as a duplicate."""
    client.enqueue(GenerateRequest(prompt="x", request_id="c0"))
    assert client.cancel("c0") == "cancelled"
    ensure_group(redis_client, KEYS)
    [(entry, _fields)], _marks = fair.pull(redis_client, KEYS.requests, KEYS.group, "w1", 5)
    assert start_job(redis_client, KEYS, "c0", "w1", TTLS, entry_id=entry) == "skip"
    assert redis_client.hget(KEYS.job("c0"), "state") == b"cancelled"
    assert redis_client.llen(KEYS.events("c0")) == 1  # the cancel's event, and no other


def test_cancel_running_and_finished(client: FerryClient, redis_client: redis.Redis) -> None:
    client.enqueue(GenerateRequest(prompt="x", request_id="c2"))
    assert redis_client.hget(KEYS.job("c2"), "entry_id") is None  # named by its worker
    ensure_group(redis_client, KEYS)
    [(entry, _fields)], _marks = fair.pull(redis_client, KEYS.requests, KEYS.group, "w1", 5)
    assert start_job(redis_client, KEYS, "c2", "w1", TTLS, entry_id=entry) == "run"
    assert client.cancel("c2") == "running"
    assert redis_client.exists(KEYS.cancelled("c2"))
    assert client.result("c2").state == "running"  # type: ignore[union-attr]
    assert start_job(redis_client, KEYS, "c2", "w2", TTLS, entry_id=entry) == "cancel"
    redis_client.hset(KEYS.job("c2"), "state", "done")
    assert client.cancel("c2") == "done"
    assert start_job(redis_client, KEYS, "c2", "w2", TTLS, entry_id=entry) == "skip"
    # another entry carrying the same id (a producer that bypassed the enqueue script)
    assert start_job(redis_client, KEYS, "c2", "w2", TTLS, entry_id="1-1") == "duplicate"
    assert client.cancel("never-seen") == "unknown"
