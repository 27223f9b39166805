"""Queue integrity and priority lanes, in-process against a real redis-server.

* A stream entry reusing another job's ``request_id`` never touches that job's hash, log
  or channel: it is dead-lettered under its own entry id (valid payload or not).
* Prompts are tokenized off the engine loop, and an absurdly long one is refused by a
  cheap bound before it is tokenized; a refusal reports how many tokens the prompt has.
* Priority lanes: a high-priority request is the next one admitted, even on a full worker.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import pytest
import redis

from protocol.client import FerryClient
from protocol.codec import decode_event, encode_request, status_from_hash
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.worker.service.conftest import make_engine
from tests.worker.service.procs import assert_contiguous, tokens_of
from tests.worker.service.test_service_inprocess import Running

KEYS = Keys()


def _finished_job(client: FerryClient, engine: Any, redis_url: str, rid: str) -> list[bytes]:
    request = GenerateRequest(request_id=rid, prompt="def a():",
                              params=SamplingParams(max_tokens=8, temperature=0))
    with Running(engine, redis_url):
        events = _stream(client, request)
    assert events[-1].finish_reason in ("stop", "length")
    return list(client.redis.lrange(KEYS.events(rid), 0, -1))


def _stream(client: FerryClient, request: GenerateRequest) -> Any:
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        return list(sub.events(timeout=60))


def _wait_dead_letters(r: redis.Redis, n: int, timeout: float = 20.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entries = r.xrange(KEYS.dead_letter)
        if len(entries) >= n:
            return list(entries)
        time.sleep(0.05)
    raise AssertionError(f"expected {n} dead letters, got {r.xrange(KEYS.dead_letter)}")


@pytest.mark.parametrize("payload", [
    {"version": 1, "request_id": "v1", "prompt": "x"},  # a valid request reusing the id
    {"version": 1, "request_id": "v1", "prompt": "x", "bogus": 1},  # an invalid one
])
def test_entry_reusing_a_finished_jobs_id_leaves_that_job_alone(
    engine: Any, client: FerryClient, redis_server: Any, payload: dict[str, Any]
) -> None:
    r = client.redis
    r.delete(KEYS.job("v1"), KEYS.events("v1"), KEYS.dead_letter)
    log_before = _finished_job(client, engine, redis_server.url, "v1")
    job_before = r.hgetall(KEYS.job("v1"))
    with Running(engine, redis_server.url):
        pubsub = r.pubsub()
        pubsub.subscribe(KEYS.tokens("v1"))
        entry_id = r.xadd(KEYS.requests, {"data": msgpack.packb(payload, use_bin_type=True)})
        [dead] = _wait_dead_letters(r, 1)
    assert r.hgetall(KEYS.job("v1")) == job_before
    assert status_from_hash(job_before).state == "done"
    assert list(r.lrange(KEYS.events("v1"), 0, -1)) == log_before
    published = [m for m in iter(lambda: pubsub.get_message(timeout=0.2), None)
                 if m["type"] == "message"]
    pubsub.close()
    assert published == []
    fields = dead[1]
    assert fields[b"entry_id"] == entry_id and fields[b"stream"] == KEYS.requests.encode()
    assert r.xlen(KEYS.requests) == 0  # acknowledged and deleted, not left pending


def test_raw_producer_entries_claim_their_id_once(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    """No job hash (a producer that XADDs directly): the first entry claims the id and runs;
    a second entry with the same id is dead-lettered without an event."""
    r = client.redis
    r.delete(KEYS.dead_letter)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = GenerateRequest(request_id="raw-1", prompt="import os", params=params)
    with client.subscribe("raw-1") as sub:
        r.xadd(KEYS.requests, {"data": encode_request(first)})
        with Running(engine, redis_server.url):
            events = sub.next_events(20)
            r.xadd(KEYS.requests, {"data": encode_request(first)})  # same id, second entry
            events += list(sub.events(timeout=60))
            _wait_dead_letters(r, 1)
    assert_contiguous(events)
    assert len(tokens_of(events)) == 40
    assert status_from_hash(r.hgetall(KEYS.job("raw-1"))).state == "done"


def test_prompts_are_built_off_the_engine_loop(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    """Every prompt is tokenized on the prompt pool, never on the engine loop's thread."""
    threads: list[str] = []
    original = engine.prompts.build

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    engine.prompts.build = spy
    try:
        with Running(engine, redis_server.url) as running:
            loop_thread = running.thread.name
            requests = [GenerateRequest(prompt=p, params=SamplingParams(max_tokens=4))
                        for p in ("def f():", "x = 1\n" * 20, "class A:")]
            for request in requests:
                assert _stream(client, request)[-1].finish_reason in ("stop", "length")
    finally:
        engine.prompts.build = original
    assert len(threads) == 3
    assert all(name.startswith("ferry-prompts") for name in threads), threads
    assert loop_thread not in threads


def test_refusals_report_prompt_tokens_and_huge_prompts_skip_the_tokenizer(
    engine: Any, client: FerryClient, redis_server: Any
) -> None:
    calls: list[int] = []
    original = engine.prompts.tokenize

    def spy(prompt: Any, messages: Any, *rest: Any) -> Any:
        calls.append(len(prompt or ""))
        return original(prompt, messages, *rest)

    engine.prompts.tokenize = spy
    try:
        long_prompt = "x = 1\n" * 150  # over the 512-token context, not absurdly
        expected = len(engine.tokenizer(long_prompt)["input_ids"])
        huge = "y" * 2_000_000
        with Running(engine, redis_server.url):
            over = _stream(client, GenerateRequest(prompt=long_prompt))[-1]
            absurd = _stream(client, GenerateRequest(prompt=huge))[-1]
    finally:
        engine.prompts.tokenize = original
    assert over.finish_reason == "error" and over.error_kind == "invalid_request"
    assert over.usage is not None and over.usage.prompt_tokens == expected > 512
    assert "maximum context length is 512 tokens" in (over.error or "")
    assert over.error_code == "context_length_exceeded" and over.error_param == "prompt"
    assert absurd.error_kind == "invalid_request" and "at least" in (absurd.error or "")
    assert absurd.usage is not None and absurd.usage.prompt_tokens > 512
    assert calls == [len(long_prompt)]  # the 2 MB prompt never reached the tokenizer


def test_high_priority_request_is_admitted_next_on_a_full_worker(
    checkpoint: str, client: FerryClient, redis_server: Any
) -> None:
    """4 long requests fill the batch; 12 wait at priority 10; then one at -100 arrives.
    It is read from the high lane at once and preempts a running request: it starts before
    any of the 12, and streams its first token before any of the 4 long requests ends."""
    small = make_engine(checkpoint, max_num_seqs=4)
    r = client.redis
    long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    running = [GenerateRequest(prompt=f"def f{i}():", params=long) for i in range(4)]
    queued = [GenerateRequest(prompt=f"import m{i}", params=short, priority=10)
              for i in range(12)]
    urgent = GenerateRequest(prompt="class Urgent:", params=short, priority=-100)
    with Running(small, redis_server.url):
        for request in running:
            client.enqueue(request)
        _wait_state(r, [q.request_id for q in running], "running")
        for request in [*queued, urgent]:
            client.enqueue(request)
        streams = {q.request_id: list(client.stream(q.request_id, timeout=120))
                   for q in [urgent, *queued]}
        for request in running:
            list(client.stream(request.request_id, timeout=120))
    started = {rid: float(r.hget(KEYS.job(rid), "started_at") or 0) for rid in streams}
    first = min(started, key=lambda rid: started[rid])
    assert first == urgent.request_id, sorted(started.items(), key=lambda kv: kv[1])
    timings = streams[urgent.request_id][-1].timings
    assert timings is not None and timings.ttft_s is not None
    urgent_first_token = urgent.created_at + timings.ttft_s
    long_ends = [float(r.hget(KEYS.job(q.request_id), "finished_at") or 0) for q in running]
    assert urgent_first_token < min(long_ends), (timings, long_ends)
    assert r.xlen(KEYS.requests_band("high")) == 0 and r.xlen(KEYS.requests_band("low")) == 0
    for events in streams.values():
        assert_contiguous(events)
        assert decode_event(r.lindex(KEYS.events(events[0].request_id), -1)).is_final


def _wait_state(r: redis.Redis, ids: list[str], state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(status_from_hash(r.hgetall(KEYS.job(i))).state == state for i in ids):
            return
        time.sleep(0.05)
    raise AssertionError(f"not all {state}: {[r.hget(KEYS.job(i), 'state') for i in ids]}")
