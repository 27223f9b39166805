"""The worker service in-process (engine loop on a thread) against a real redis-server.

Cases that need a precise setup rather than a crash: a pre-filled replay log (resume),
an entry claimed away mid-generation (fencing), dead-lettering, deadlines, cancels that
race with the intake, a model without a chat template.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack

from protocol.client import FerryClient
from protocol.codec import encode_event, encode_request
from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent
from protocol.sampling import SamplingParams
from protocol.tenants import fair
from tests.worker.service.procs import assert_contiguous, tokens_of
from worker.service.redis.connection import WorkerSettings

KEYS = Keys()


class Running:
    """A WorkerService on a thread; ``stop()`` drains it like a SIGTERM would."""

    def __init__(self, engine: Any, url: str, **kw: Any) -> None:
        from worker.service.service import WorkerService

        settings = WorkerSettings(redis_url=url, worker_id=f"inproc-{uuid.uuid4().hex[:6]}",
                                  heartbeat_interval_s=0.2, **kw)
        self.service = WorkerService(engine, settings)
        self.thread = threading.Thread(target=self.service.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.service.request_stop(force=True)
        self.thread.join(20)
        assert not self.thread.is_alive()


def _generate(client: FerryClient, request: GenerateRequest) -> list[TokenEvent]:
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        return list(sub.events(timeout=60))


def test_resume_from_replay_log_continues_seeded_run(
    engine: Any, client: FerryClient, redis_server: Any, reference: Any
) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    full, _text = reference.run("Grüße, naïve café", params)
    request = GenerateRequest(prompt="Grüße, naïve café", params=params)
    client.enqueue(request)  # no worker yet: then fake a crashed worker's first 3 events
    for seq in range(3):
        event = TokenEvent(request_id=request.request_id, seq=seq, token_ids=full[seq:seq + 1])
        client.redis.rpush(KEYS.events(request.request_id), encode_event(event))
    with Running(engine, redis_server.url):
        events = list(client.stream(request.request_id, timeout=60))
    assert_contiguous(events)
    assert tokens_of(events) == full
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 24


def test_lost_lease_stops_publishing(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    """Once another consumer owns the entry, the worker never appends another event."""
    request = GenerateRequest(prompt="The quick brown fox",
                              params=SamplingParams(max_tokens=450, ignore_eos=True))
    with Running(engine, redis_server.url) as running:
        with client.subscribe(request.request_id) as sub:
            client.enqueue(request)
            while not sub.next_events(10):
                pass
        entry_id = client.redis.xpending_range(KEYS.requests, KEYS.group, "-", "+", 1)[0][
            "message_id"]
        client.redis.xclaim(KEYS.requests, KEYS.group, "thief", 0, [entry_id], justid=True)
        length = client.redis.llen(KEYS.events(request.request_id))
        deadline = time.monotonic() + 10
        while running.service.engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running.service.engine.stats().num_running == 0
        assert client.redis.llen(KEYS.events(request.request_id)) == length
        stats = running.service.engine.stats()
        assert stats.kv_blocks_free == stats.kv_blocks_total


def test_own_entry_reclaimed_by_own_reaper_keeps_running(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    """After an outage longer than the lease, the reaper may claim the worker's own entry:
    that is not a duplicate request, the request just goes on."""
    request = GenerateRequest(prompt="The quick brown fox",
                              params=SamplingParams(max_tokens=450, ignore_eos=True))
    with Running(engine, redis_server.url) as running:
        intake = running.service.intake
        with client.subscribe(request.request_id) as sub:
            client.enqueue(request)
            events = sub.next_events(10)
            while not events:
                events = sub.next_events(10)
            [(entry_id, fields)] = client.redis.xrange(KEYS.requests)
            assert (KEYS.requests, entry_id.decode()) in running.service.held
            intake._process(KEYS.requests, [(entry_id, fields)],
                            {entry_id.decode(): 2})  # as the reaper would
            events += list(sub.events(timeout=60))
    assert_contiguous(events)
    assert events[-1].finish_reason == "length" and len(tokens_of(events)) == 450
    assert client.redis.xlen(KEYS.dead_letter) == 0


def test_dead_letters_and_keeps_serving(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    r = client.redis
    r.script_flush()  # as on a fresh Redis: the dead letter's script runs first time here
    r.xadd(KEYS.requests, {"data": b"\xc1 not msgpack"})
    r.xadd(KEYS.requests, {"other": b"x"})
    bad = {"version": 1, "request_id": "poison-1", "prompt": "x", "params": {"max_token": 5}}
    r.xadd(KEYS.requests, {"data": msgpack.packb(bad)})
    with Running(engine, redis_server.url):
        events = list(client.stream("poison-1", timeout=30))
        ok = _generate(client, GenerateRequest(prompt="still alive",
                                               params=SamplingParams(max_tokens=4)))
    assert events[-1].finish_reason == "error" and events[-1].error_kind == "invalid_request"
    assert "params.max_token" in (events[-1].error or "")
    assert ok[-1].finish_reason in ("stop", "length")
    dead = r.xrange(KEYS.dead_letter)
    assert len(dead) == 3 and all(b"reason" in fields for _id, fields in dead)
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_max_deliveries_dead_letters_with_error_event(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    """An entry every worker died on (3 deliveries) is not tried a 4th time."""
    r = client.redis
    request = GenerateRequest(prompt="poison", params=SamplingParams(max_tokens=4))
    client.enqueue(request)
    fair.pull(r, KEYS.requests, KEYS.group, "ghost", 1)  # taken as a worker takes it
    entry_id = r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 1)[0]["message_id"]
    for _ in range(2):  # two more deliveries to dead consumers
        r.xclaim(KEYS.requests, KEYS.group, "ghost", 0, [entry_id], idle=10**9)
    with Running(engine, redis_server.url, lease_s=1.0, max_deliveries=3):
        events = list(client.stream(request.request_id, timeout=30))
    assert events[-1].finish_reason == "error" and events[-1].error_kind == "internal"
    assert len(r.xrange(KEYS.dead_letter)) == 1
    assert r.hget(KEYS.job(request.request_id), "state") == b"failed"


def test_deadlines(engine: Any, client: FerryClient, redis_server: Any) -> None:
    now = time.time()
    long = SamplingParams(max_tokens=450, ignore_eos=True)
    expired = GenerateRequest(prompt="late", params=long, created_at=now - 10, timeout_s=5)
    running = GenerateRequest(prompt="slow", params=long, created_at=now - 9.5, timeout_s=10)
    with Running(engine, redis_server.url):
        a = _generate(client, expired)
        b = _generate(client, running)
    assert a[-1].finish_reason == "timeout" and a[-1].seq == 0
    assert b[-1].finish_reason == "timeout" and "timeout_s" in (b[-1].error or "")
    assert_contiguous(b)


def test_cancelled_before_start(engine: Any, client: FerryClient, redis_server: Any) -> None:
    """Queued + cancelled: finished by the cancel itself; the worker only acknowledges.
    Cancel mark on a job that is (re)started: the worker ends it with 'cancelled'."""
    queued = GenerateRequest(prompt="never", params=SamplingParams(max_tokens=4))
    client.enqueue(queued)
    assert client.cancel(queued.request_id) == "cancelled"
    marked = GenerateRequest(prompt="marked", params=SamplingParams(max_tokens=4))
    client.enqueue(marked)
    client.redis.hset(KEYS.job(marked.request_id), "state", "running")
    client.redis.set(KEYS.cancelled(marked.request_id), "stop it")
    with Running(engine, redis_server.url):
        events = list(client.stream(marked.request_id, timeout=30))
        deadline = time.monotonic() + 10
        while client.redis.xpending(KEYS.requests, KEYS.group)["pending"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
    assert [e.finish_reason for e in events] == ["cancelled"] and events[0].error == "stop it"
    assert client.redis.llen(KEYS.events(queued.request_id)) == 1  # only the cancel's event
    assert client.redis.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_chat_without_template_is_invalid_request(
    checkpoint: str, client: FerryClient, redis_server: Any, tmp_path: Path
) -> None:
    from worker import Engine, EngineConfig

    plain = tmp_path / "no-template"
    shutil.copytree(checkpoint, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig.create(str(plain), device="cpu", num_blocks=32))
    request = GenerateRequest(messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    with Running(engine, redis_server.url):
        events = _generate(client, request)
    assert events[-1].finish_reason == "error" and events[-1].error_kind == "invalid_request"
    assert (events[-1].error or "").startswith("messages:")


def test_stream_false_sends_one_coalesced_event(
    engine: Any, client: FerryClient, redis_server: Any, reference: Any
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    request = GenerateRequest(prompt="Ferry", params=params, stream=False)
    with Running(engine, redis_server.url):
        events = _generate(client, request)
    ids, text = reference.run("Ferry", params)
    assert len(events) == 1 and events[0].token_ids == ids and events[0].text == text
    assert encode_request(request)  # the request itself round-trips
