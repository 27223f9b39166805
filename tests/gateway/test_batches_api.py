"""Batches API through the official openai SDK: real uvicorn and Redis, an in-process batcher,
and the scripted fake worker (the real workers are in tests/worker/service/test_batch_up.py).

Each line's result is the answer its route gives to the same body (the same schemas and
formatter), refusals included; bad lines land in the error file and the rest run; lines
go to the low lane, a bounded number at a time; cancel, expiry, a batch with no valid
line, a vanished input file, validation of the create call and ownership.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, write_heartbeat
from protocol.tenants import fair
from tests.gateway.batcher_thread import BatcherThread
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
ENDED = ("completed", "failed", "expired", "cancelled")


@contextlib.contextmanager
def stack(redis_server: RedisServer, batcher: bool = True,
          **overrides: Any) -> Iterator[tuple[GatewayServer, openai.OpenAI]]:
    settings = GatewaySettings(**{
        "redis_url": redis_server.url, "batch_poll_interval_s": 0.05, "batch_lease_s": 2.0,
        "max_tokens_limit": 64, **overrides})
    key = settings.api_keys[0] if settings.api_keys else "none"
    with GatewayServer(settings) as gateway, contextlib.ExitStack() as more:
        if batcher:
            more.enter_context(BatcherThread(settings, "test-batcher"))
        yield gateway, openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def submit(client: openai.OpenAI, lines: list[str], endpoint: str = "/v1/completions",
           **kw: Any) -> Any:
    data = ("\n".join(lines) + "\n").encode()
    source = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint=endpoint,  # type: ignore[arg-type]
                                 completion_window="24h", **kw)


def wait(client: openai.OpenAI, batch_id: str, until: Any = None, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if (until(batch) if until else batch.status in ENDED):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.05)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    rows = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    return {row["custom_id"]: row for row in rows}


def test_a_prompt_list_line_runs_as_the_route_runs_it(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A line with a list of prompts (one request per prompt, as the route) gets one
    result whose choices are indexed by prompt and whose usage is summed."""
    with stack(redis_server) as (_gateway, client), \
            FakeWorker(redis_server.url, Script(tokens=["Hel", "lo"])):
        done = wait(client, submit(client, [line("pair", {**GOOD, "prompt": ["a", "b"]})]).id)
        out = results(client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 1
    body = out["pair"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == "Hello" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 2 * 2 == done.usage.output_tokens


def _same_answer(body: dict[str, Any], route: dict[str, Any]) -> None:
    """A result body equals the route's response but for the per-request id and time."""
    skip = {"id", "created"}
    assert {k: v for k, v in body.items() if k not in skip} == \
        {k: v for k, v in route.items() if k not in skip}


GOOD = {"prompt": "Say hi", "max_tokens": 5, "temperature": 0, "stop": "\n"}
REFUSED = {  # bodies the route itself refuses, each for its own reason
    "max0": {"prompt": "x", "max_tokens": 0},
    "over": {"prompt": "x", "max_tokens": 65},
    "logprobs": {"prompt": "x", "logprobs": 21},
    "best_of": {"prompt": "x", "n": 2, "best_of": 1},
    "temp": {"prompt": "x", "temperature": "hot"},
    "model": {"prompt": "x", "model": "gpt-none"},
}


def test_lines_get_the_routes_answers_and_bad_lines_the_error_file(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    with stack(redis_server) as (gateway, client), \
            FakeWorker(redis_server.url, Script(tokens=["Hel", "lo", "!"])) as worker:
        lines = [line(f"ok{i}", {**GOOD, "max_tokens": 3 + i}) for i in range(4)]
        lines += [line(name, body) for name, body in REFUSED.items()]
        lines += [line("url", GOOD, url="/v1/chat/completions"), "{not json", "",
                  line("ok0", GOOD), json.dumps({"custom_id": "m", "method": "GET",
                                                 "url": "/v1/completions", "body": GOOD})]
        batch = submit(client, lines, metadata={"run": "t1"})
        assert batch.status == "validating" and batch.metadata == {"run": "t1"}
        done = wait(client, batch.id)
        route = {name: httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
                 for name, body in [*REFUSED.items(), ("ok0", {**GOOD, "max_tokens": 3})]}
        out, err = results(client, done.output_file_id), results(client, done.error_file_id)
        output = client.files.retrieve(done.output_file_id)
        content = client.files.content(done.output_file_id).content
    assert done.status == "completed" and done.model == "fake-model"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (14, 4, 10)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert done.usage.input_tokens == 4 * 3 and done.usage.output_tokens == 4 * 3
    assert sorted(out) == ["ok0", "ok1", "ok2", "ok3"] and len(err) == 10
    _same_answer(out["ok0"]["response"]["body"], route["ok0"].json())
    assert out["ok0"]["response"]["status_code"] == 200 and out["ok0"]["error"] is None
    for name in REFUSED:  # the very answer the endpoint gives, status and body
        assert err[name]["response"]["status_code"] == route[name].status_code, name
        assert err[name]["response"]["body"] == route[name].json(), name
    assert {err[k]["error"]["code"] for k in ("url", None, "m")} == {
        "invalid_url", "invalid_json_line", "invalid_method"}
    assert err["ok0"]["error"]["code"] == "duplicate_custom_id"  # the later one is refused
    assert "line 1" in err["ok0"]["error"]["message"]
    assert output.purpose == "batch_output" and output.bytes == len(content)
    seen = {r.request_id: r for r in worker.seen if r.request_id.startswith(batch.id)}
    assert sorted(seen) == sorted(f"{batch.id}-{i}" for i in range(4))
    assert all(r.priority >= 1 and not r.stream for r in seen.values())
    lanes = {redis_client.hget(KEYS.job(rid), "stream") for rid in seen}
    assert lanes == {KEYS.requests_band("low").encode()}


def test_a_chat_batch_answers_as_the_chat_route(redis_server: RedisServer,
                                                redis_client: redis.Redis) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
    with stack(redis_server) as (gateway, client), FakeWorker(redis_server.url):
        done = wait(client, submit(client, [line("c", body, url="/v1/chat/completions")],
                                   endpoint="/v1/chat/completions").id)
        route = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
        answer = results(client, done.output_file_id)["c"]["response"]["body"]
    assert done.status == "completed"
    assert answer["object"] == "chat.completion"
    _same_answer(answer, route.json())


def test_feeding_is_bounded_on_the_low_lane_and_cancel_ends_it(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    with stack(redis_server, batch_max_in_flight=3) as (_gateway, client):  # no worker
        batch = submit(client, [line(f"c{i}", GOOD) for i in range(10)])
        wait(client, batch.id, lambda b: b.status == "in_progress")
        deadline = time.monotonic() + 10
        while redis_client.xlen(fair.bell(KEYS.requests_band("low"))) < 3:  # its backlog
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # ten polls: nothing more is fed while three wait
        lanes = [redis_client.xlen(fair.bell(s)) for s in KEYS.request_streams]
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at
        done = wait(client, batch.id)
        again = client.batches.cancel(batch.id)
        err = results(client, done.error_file_id)
    assert lanes == [0, 0, 3]
    assert done.status == "cancelled" and done.cancelled_at and done.output_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 10)
    assert {row["error"]["code"] for row in err.values()} == {"batch_cancelled"}
    assert sorted(err) == sorted(f"c{i}" for i in range(10))
    states = {redis_client.hget(KEYS.job(f"{batch.id}-{i}"), "state") for i in range(3)}
    assert states == {b"cancelled"}  # the queued ones will never run
    assert again.status == "cancelled"


def test_all_batches_together_keep_to_the_fleets_share(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """Two workers of 6 slots (heartbeats only: nothing runs) and a 25% share: 3 lines in
    flight over both batches, though each batch alone may have 8."""
    pipe = redis_client.pipeline()
    for worker in ("w1", "w2"):
        beat = WorkerHeartbeat(worker_id=worker, model="fake-model", started_at=1.0,
                               updated_at=1.0, stats={"max_num_seqs": 6})
        write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=120))
    pipe.execute()
    with stack(redis_server, batch_max_in_flight=8, batch_fleet_share=0.25) as (_gw, client):
        batches = [submit(client, [line(f"c{i}", GOOD) for i in range(10)]) for _ in range(2)]
        for batch in batches:
            wait(client, batch.id, lambda b: b.status == "in_progress")
        deadline = time.monotonic() + 10
        while redis_client.xlen(fair.bell(KEYS.requests_band("low"))) < 3:  # its backlog
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        fed = [redis_client.scard(KEYS.batch_inflight(b.id)) for b in batches]
        queued = redis_client.xlen(fair.bell(KEYS.requests_band("low")))
        for batch in batches:
            client.batches.cancel(batch.id)
    assert queued == sum(fed) == 3 and min(fed) >= 1  # both batches got a share


def test_expiry_ends_the_batch_and_reports_what_never_ran(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    script = Script(tokens=["a", "b"], delay_s=0.2)
    with stack(redis_server, batch_completion_window_s=2, batch_max_in_flight=2) as (
            _gateway, client), FakeWorker(redis_server.url, script):
        batch = submit(client, [line(f"c{i}", GOOD) for i in range(30)])
        done = wait(client, batch.id)
        err, out = results(client, done.error_file_id), results(client, done.output_file_id)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    counts = done.request_counts
    assert counts.completed + counts.failed == counts.total == 30 and counts.failed > 0
    assert {row["error"]["code"] for row in err.values()} == {"batch_expired"}
    assert len(err) + len(out) == 30 and not set(err) & set(out)


def test_a_batch_with_no_valid_line_fails_with_its_errors(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    with stack(redis_server) as (_gateway, client):
        done = wait(client, submit(client, ["[1, 2]", line("a", {"prompt": 5})]).id)
        err = results(client, done.error_file_id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [(1, "invalid_json_line"),
                                                           (2, "invalid_request")]
    assert done.errors.data[1].param.startswith("prompt")  # as the route names it
    assert len(err) == 2


def test_a_deleted_input_file_fails_the_rest(redis_server: RedisServer,
                                             redis_client: redis.Redis) -> None:
    with stack(redis_server, batch_max_in_flight=2) as (_gateway, client), \
            FakeWorker(redis_server.url, Script(tokens=["a", "b"], delay_s=0.1)):
        batch = submit(client, [line(f"c{i}", GOOD) for i in range(12)])
        wait(client, batch.id, lambda b: b.status == "in_progress")
        client.files.delete(batch.input_file_id)
        done = wait(client, batch.id)
        err = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert done.status == "failed" and done.errors.data[0].code == "file_not_found"
    counts = done.request_counts
    assert counts.completed + counts.failed == 12 and counts.failed == len(err) > 0
    assert {r["error"]["code"] for r in err} == {"file_not_found"}


def test_create_checks_its_fields_and_owners_see_only_their_batches(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    with stack(redis_server, batcher=False, api_keys=("alice", "bob")) as (gateway, alice):
        bob = openai.OpenAI(base_url=gateway.url + "/v1", api_key="bob", max_retries=0)
        source = alice.files.create(file=("a.jsonl", io.BytesIO(line("a", GOOD).encode())),
                                    purpose="batch")
        bad: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"endpoint": "/v1/embeddings"}, openai.BadRequestError, "endpoint"),
            ({"completion_window": "1h"}, openai.BadRequestError, "completion_window"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, openai.BadRequestError,
             "metadata"),
            ({"metadata": {"k": "v" * 513}}, openai.BadRequestError, "metadata"),
            ({"input_file_id": "file-0123456789abcdef"}, openai.NotFoundError, "input_file_id"),
        ]
        for change, error, param in bad:
            args = {"input_file_id": source.id, "endpoint": "/v1/completions",
                    "completion_window": "24h", **change}
            with pytest.raises(error) as caught:
                alice.batches.create(**args)
            assert caught.value.body["param"] == param  # type: ignore[attr-defined]
        ids = [alice.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                    completion_window="24h").id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):  # bob cannot use alice's file either
            bob.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                               completion_window="24h")
        for call in (bob.batches.retrieve, bob.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                call(ids[0])
        page = alice.batches.list(limit=2)
        rest = alice.batches.list(limit=2, after=page.data[-1].id)
        cancelled = alice.batches.cancel(ids[0])
        assert bob.batches.list().data == []
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert cancelled.status == "cancelling"
    assert redis_client.zrange(KEYS.batches_active, 0, -1) == [i.encode() for i in ids]
