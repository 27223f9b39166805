"""A batch that breaks the batcher ends, and one tenant cannot hold every batcher slot.

Real uvicorn and Redis, an in-process batcher (``BatcherThread``) and the scripted fake
worker, two tenants (``FERRY_API_KEYS=key-a,key-b``). The attack: lines nested 50,000
deep made ``json.loads`` raise ``RecursionError`` in the batcher, which crashed on the
batch and took it again on every scan; eight such batches held all eight slots, another
tenant's batch never started, and a cancel stayed ``cancelling``. Now such a line is that
line's error, a run that keeps failing is given up after ``MAX_FAILURES`` (counted in
Redis), and slots go round-robin by owner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import redis

from gateway.batcher.run import MAX_FAILURES
from gateway.body import MAX_DEPTH
from gateway.settings import GatewaySettings
from protocol.keys import Keys
from tests.gateway.batcher_thread import BatcherThread
from tests.gateway.server import GatewayServer
from tests.gateway.test_batches_api import GOOD, line, results, submit, wait
from tests.protocol.fake_worker import FakeWorker
from tests.redis_server import RedisServer

KEYS = Keys()
DEEP = '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": ' \
       '{"prompt": "x", "stop": ' + "[" * 50_000 + "]" * 50_000 + "}}"
OPEN = ("validating", "in_progress", "finalizing", "cancelling")


@contextlib.contextmanager
def tenants(redis_server: RedisServer, batcher: bool = True, **overrides: Any) -> Iterator[
        tuple[GatewaySettings, openai.OpenAI, openai.OpenAI]]:
    """A gateway with two tenants' keys, a client for each, and a batcher (8 slots)."""
    settings = GatewaySettings(**{
        "redis_url": redis_server.url, "api_keys": ("key-a", "key-b"),
        "batch_poll_interval_s": 0.05, "batch_lease_s": 2.0, "max_tokens_limit": 64,
        **overrides})
    with GatewayServer(settings) as gateway, contextlib.ExitStack() as more:
        if batcher:
            more.enter_context(BatcherThread(settings, "faults-batcher"))
        yield settings, *(openai.OpenAI(base_url=gateway.url + "/v1", api_key=key,
                                        max_retries=0) for key in settings.api_keys)


def test_deep_lines_are_line_errors_and_another_tenant_still_runs(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The issue's attack: eight batches of 50,000-deep lines from tenant a (one cancelled
    at once), then one line from tenant b. b's batch completes; a's batches end, each deep
    line with the route's 400, none left ``validating`` or ``cancelling``."""
    with tenants(redis_server) as (settings, a, b), FakeWorker(redis_server.url):
        assert settings.batch_max_active == 8
        attack = [submit(a, [DEEP] if i % 2 else [DEEP, line("ok", GOOD)]) for i in range(8)]
        try:
            a.batches.cancel(attack[0].id)
            cancel_taken = True
        except openai.ConflictError:  # a loaded machine: it was finalizing already
            cancel_taken = False
        mine = submit(b, [line("b", GOOD)])
        done = wait(b, mine.id, timeout=60)
        ended = [wait(a, batch.id, timeout=60) for batch in attack]
        errors = [results(a, batch.error_file_id) for batch in ended]
        outputs = [results(a, batch.output_file_id) for batch in ended[1:]]
    assert done.status == "completed" and done.request_counts.completed == 1
    # the cancel may come after the end (failed), or once it is finalizing (a 409)
    assert ended[0].status in (("cancelled", "failed") if cancel_taken else ("completed",))
    statuses = [batch.status for batch in ended[1:]]
    assert statuses == ["failed" if i % 2 else "completed" for i in range(1, 8)]
    for batch, error in zip(ended, errors, strict=True):
        counts = batch.request_counts
        assert counts.completed + counts.failed == counts.total and counts.failed >= 1
        response = error["deep"]["response"]  # validated even when cancelled at once
        assert response["status_code"] == 400
        assert response["body"]["error"]["type"] == "invalid_request_error"
        assert response["body"]["error"]["message"].startswith(
            "body: nested too deep (50001 levels")
    assert all(out["ok"]["response"]["status_code"] == 200 for out in outputs[1::2])
    failed = ended[1]  # no line could run: the batch's errors name the deep line
    assert [(e.line, e.code) for e in failed.errors.data] == [(1, "invalid_request")]
    assert f"the limit is {MAX_DEPTH}" in failed.errors.data[0].message
    assert redis_client.zcard(KEYS.batches_active) == 0


def test_a_tenants_batches_leave_a_slot_for_another_tenant(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Eight long batches of tenant a hold the batcher's eight slots (no worker: their
    lines wait); tenant b's batch, created after them, still starts at once (a's youngest
    yields its slot and goes on later), and all nine complete once a worker comes."""
    with tenants(redis_server) as (_settings, a, b):
        flood = [submit(a, [line(f"a{i}", GOOD) for i in range(3)]) for _ in range(8)]
        for batch in flood:
            wait(a, batch.id, lambda x: x.status == "in_progress", timeout=30)
        late = submit(b, [line("b", GOOD)])
        started = wait(b, late.id, lambda x: x.status != "validating", timeout=30)
        running = [a.batches.retrieve(batch.id).status for batch in flood]
        with FakeWorker(redis_server.url):
            done = [wait(b, late.id, timeout=60)] + [wait(a, x.id, timeout=60) for x in flood]
    assert started.status == "in_progress"
    assert running == ["in_progress"] * 8  # b did not wait for one of a's to end
    assert [x.status for x in done] == ["completed"] * 9
    assert sum(x.request_counts.completed for x in done) == 1 + 8 * 3


def test_a_run_that_keeps_failing_is_given_up(redis_server: RedisServer,
                                              redis_client: redis.Redis) -> None:
    """A batch whose run raises on every tick (its in-flight set holds a member that is
    no line number) is retried, then ends ``failed`` after ``MAX_FAILURES``, with an
    ``errors`` entry and every line reported; the batcher goes on with other batches."""
    with tenants(redis_server) as (_settings, a, b):  # no worker: the lines wait
        batch = submit(a, [line(f"c{i}", GOOD) for i in range(4)])
        wait(a, batch.id, lambda x: x.status == "in_progress", timeout=30)
        redis_client.sadd(KEYS.batch_inflight(batch.id), "not-a-line")
        ended = wait(a, batch.id, timeout=30)
        errors = results(a, ended.error_file_id)
        with FakeWorker(redis_server.url):
            other = wait(b, submit(b, [line("b", GOOD)]).id, timeout=60)
    assert ended.status == "failed" and ended.failed_at
    assert [e.code for e in ended.errors.data] == ["batch_run_failed"]
    assert f"{MAX_FAILURES} times (ValueError" in ended.errors.data[0].message
    assert int(redis_client.hget(KEYS.batch(batch.id), "failures")) == MAX_FAILURES
    counts = ended.request_counts
    assert (counts.total, counts.completed, counts.failed) == (4, 0, 4)
    assert sorted(errors) == [f"c{i}" for i in range(4)]
    assert {row["error"]["code"] for row in errors.values()} == {"batch_failed"}
    assert other.status == "completed"
    assert redis_client.zcard(KEYS.batches_active) == 0


def test_a_cancelled_batch_that_keeps_failing_ends_cancelled(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Validation raises on every attempt (the input file's record is corrupt); the batch
    was cancelled. Two earlier batchers already failed on it (the count is in Redis), so
    this batcher gives it up at its first failure: ``cancelled``, never stuck
    ``cancelling``."""
    with tenants(redis_server, batcher=False) as (settings, a, _b):
        batch = submit(a, [line("c0", GOOD)])
        assert a.batches.cancel(batch.id).status == "cancelling"
        redis_client.hset(KEYS.file(batch.input_file_id), "lines", "many")
        redis_client.hset(KEYS.batch(batch.id), "failures", MAX_FAILURES - 1)
        with BatcherThread(settings, "faults-batcher-3"):
            ended = wait(a, batch.id, lambda x: x.status not in OPEN, timeout=30)
    assert ended.status == "cancelled" and ended.cancelled_at
    assert [e.code for e in ended.errors.data] == ["batch_run_failed"]
    assert "ValidationError" in ended.errors.data[0].message
    assert int(redis_client.hget(KEYS.batch(batch.id), "failures")) == MAX_FAILURES
    assert redis_client.zcard(KEYS.batches_active) == 0
