"""Jobs API: create, status, resumable SSE events, cancel; plus HTTP schema fuzzing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import APIError
from gateway.openai_api.schemas import ChatCompletionRequest, CompletionRequest, JobCreate
from gateway.settings import GatewaySettings
from protocol.codec import decode_request, encode_request
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(GatewaySettings(redis_url=redis_server.url, keepalive_s=0.5)) as server:
        yield server


def _events(text: str) -> list[tuple[int, dict[str, object]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "id" in lines:
            out.append((int(lines["id"]), json.loads(lines["data"])))
    return out


def _wait_state(gw: GatewayServer, job_id: str, state: str) -> dict[str, object]:
    deadline = time.monotonic() + 5
    while True:
        body = httpx.get(f"{gw.url}/v1/jobs/{job_id}").json()
        if body["state"] == state or time.monotonic() > deadline:
            return body  # type: ignore[no-any-return]
        time.sleep(0.02)


def test_job_lifecycle_and_resumable_events(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    with FakeWorker(redis_server.url, Script(tokens=["a", "b", "c", "d"])):
        reply = httpx.post(f"{gateway.url}/v1/jobs", json={
            "request_id": "job-1", "prompt_token_ids": [5, 6], "params": {"max_tokens": 4}})
        assert reply.status_code == 202
        assert reply.json()["id"] == "job-1" and reply.headers["location"] == "/v1/jobs/job-1"
        status = _wait_state(gateway, "job-1", "done")
    assert status["text"] == "abcd" and status["finish_reason"] == "stop"
    assert status["token_ids"] == [1, 2, 3, 4]
    # which worker (consumer) ran it is the fleet's business, not the caller's: the hash
    # has it, the body does not
    assert redis_client.hget("ferry:job:job-1", "worker_id") == b"fake-worker"
    assert "fake-worker" not in json.dumps(status) and "worker_id" not in status

    events = _events(httpx.get(f"{gateway.url}/v1/jobs/job-1/events", timeout=10).text)
    assert [seq for seq, _ in events] == [0, 1, 2, 3]
    assert not any("worker_id" in e or "fake-worker" in json.dumps(e) for _, e in events)
    assert events[-1][1]["finish_reason"] == "stop" and events[0][1]["text"] == "a"
    resumed = httpx.get(f"{gateway.url}/v1/jobs/job-1/events", timeout=10,
                        headers={"Last-Event-ID": "1"})
    assert [seq for seq, _ in _events(resumed.text)] == [2, 3]
    assert httpx.get(f"{gateway.url}/v1/jobs/job-1/events?after=2").text.count("id: ") == 1
    done = httpx.get(f"{gateway.url}/v1/jobs/job-1/events", headers={"Last-Event-ID": "3"})
    assert done.status_code == 204  # stops EventSource from reconnecting forever
    assert httpx.delete(f"{gateway.url}/v1/jobs/job-1").status_code == 409
    dup = httpx.post(f"{gateway.url}/v1/jobs", json={"request_id": "job-1", "prompt": "x"})
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "request_id"


def test_live_events_then_cancel_while_queued(
    gateway: GatewayServer, redis_client: redis.Redis
) -> None:
    assert httpx.post(f"{gateway.url}/v1/jobs",
                      json={"request_id": "q-1", "prompt": "x"}).status_code == 202
    assert _wait_state(gateway, "q-1", "queued")["state"] == "queued"
    with httpx.stream("GET", f"{gateway.url}/v1/jobs/q-1/events", timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith(":")  # a keep-alive comment: no worker yet
        reply = httpx.delete(f"{gateway.url}/v1/jobs/q-1")
        assert reply.status_code == 202 and reply.json()["state"] == "cancelled"
        events = _events("\n".join(lines))
    assert [(seq, data["finish_reason"]) for seq, data in events] == [(0, "cancelled")]
    assert httpx.get(f"{gateway.url}/v1/jobs/q-1").json()["state"] == "cancelled"


def test_cancelling_an_ended_job_is_409_however_it_ended(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    assert httpx.post(f"{gateway.url}/v1/jobs",
                      json={"request_id": "c-1", "prompt": "x"}).status_code == 202
    first = httpx.delete(f"{gateway.url}/v1/jobs/c-1")
    assert first.status_code == 202 and first.json()["state"] == "cancelled"
    again = httpx.delete(f"{gateway.url}/v1/jobs/c-1")  # already cancelled: ended
    assert again.status_code == 409, again.text
    assert "cancelled" in again.json()["error"]["message"]
    assert again.json()["error"]["param"] == "id"
    with FakeWorker(redis_server.url, Script(tokens=["a"])):
        httpx.post(f"{gateway.url}/v1/jobs", json={"request_id": "c-2", "prompt": "x"})
        assert _wait_state(gateway, "c-2", "done")["state"] == "done"
    done = httpx.delete(f"{gateway.url}/v1/jobs/c-2")
    assert done.status_code == 409 and "done" in done.json()["error"]["message"]


def test_events_after_the_end_of_a_finished_job_close_with_its_terminal_event(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    with FakeWorker(redis_server.url, Script(tokens=["a", "b"])):
        httpx.post(f"{gateway.url}/v1/jobs", json={"request_id": "end-1", "prompt": "x"})
        assert _wait_state(gateway, "end-1", "done")["state"] == "done"
    start = time.monotonic()
    reply = httpx.get(f"{gateway.url}/v1/jobs/end-1/events?after=100000", timeout=10)
    assert reply.status_code == 200
    assert [(seq, data["finish_reason"]) for seq, data in _events(reply.text)] == [(1, "stop")]
    assert time.monotonic() - start < 3  # closed at once, not after keep-alives
    last = httpx.get(f"{gateway.url}/v1/jobs/end-1/events", headers={"Last-Event-ID": "1"})
    assert last.status_code == 204  # it saw the terminal event: nothing more


def test_events_after_the_end_of_a_running_job_end_with_it(
    gateway: GatewayServer, redis_client: redis.Redis
) -> None:
    httpx.post(f"{gateway.url}/v1/jobs", json={"request_id": "end-2", "prompt": "x"})
    with httpx.stream("GET", f"{gateway.url}/v1/jobs/end-2/events?after=100000",
                      timeout=10) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith(":")  # queued: a keep-alive
        assert httpx.delete(f"{gateway.url}/v1/jobs/end-2").status_code == 202
        received, deadline = [], time.monotonic() + 5
        for line in lines:  # ends with the job, not at the 600 s request timeout
            received.append(line)
            assert time.monotonic() < deadline, "the stream outlived its job"
        events = _events("\n".join(received))
    assert [(seq, data["finish_reason"]) for seq, data in events] == [(0, "cancelled")]


def test_out_of_range_resume_positions_are_400(
    gateway: GatewayServer, redis_client: redis.Redis
) -> None:
    httpx.post(f"{gateway.url}/v1/jobs", json={"request_id": "big-1", "prompt": "x"})
    huge = "99999999999999999999999"
    for headers, query, param in (({"Last-Event-ID": huge}, "", "Last-Event-ID"),
                                  ({}, f"?after={huge}", "after"),
                                  ({"Last-Event-ID": "seven"}, "", "Last-Event-ID")):
        reply = httpx.get(f"{gateway.url}/v1/jobs/big-1/events{query}", headers=headers,
                          timeout=10)
        assert reply.status_code == 400, (param, reply.status_code, reply.text[:200])
        assert reply.json()["error"]["param"] == param


def test_unknown_job_is_404(gateway: GatewayServer, redis_client: redis.Redis) -> None:
    for method, path in (("GET", "/v1/jobs/nope"), ("DELETE", "/v1/jobs/nope"),
                         ("GET", "/v1/jobs/nope/events"), ("GET", "/v1/jobs/a%20b/events")):
        reply = httpx.request(method, f"{gateway.url}{path}")
        assert reply.status_code == 404, (method, path)
        assert reply.json()["error"]["param"] == "id"


# --- fuzzing the HTTP schemas --------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=10,
)
_KEYS = st.sampled_from(
    ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
     "stop", "seed", "logprobs", "top_logprobs", "top_k", "min_p", "priority", "stream",
     "request_id", "params", "prompt_token_ids", "timeout_s", "tools", "echo"]
)
_BODIES = st.dictionaries(_KEYS, _JSON, max_size=6)
_SETTINGS = GatewaySettings()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(_BODIES, st.sampled_from([CompletionRequest, ChatCompletionRequest, JobCreate]))
def test_fuzz_http_schemas_fail_only_with_4xx(body: dict[str, object], schema: type) -> None:
    try:
        parsed = schema.model_validate(body, strict=True)
        if schema is JobCreate:
            requests = [parsed.to_generate_request()]
        else:
            requests, _shape = parsed.to_generate_requests(_SETTINGS)
        for request in requests:
            assert decode_request(encode_request(request)) == request
    except APIError as exc:
        assert 400 <= exc.status < 500 and exc.message.split(":")[0]
    except ValueError:  # pydantic ValidationError: FastAPI turns it into 422
        pass


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_BODIES, path=st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                           "/v1/jobs"]))
def test_fuzz_http_never_5xx(redis_server: RedisServer, body: dict[str, object],
                             path: str) -> None:
    # max_queue_lag=0: whatever passes validation is refused with 429, so nothing waits.
    global _FUZZ_GW
    if _FUZZ_GW is None:
        _FUZZ_GW = GatewayServer(GatewaySettings(redis_url=redis_server.url, max_queue_lag=0))
        _FUZZ_GW.__enter__()
    reply = httpx.post(f"{_FUZZ_GW.url}{path}", json=body, timeout=10)
    assert reply.status_code in (400, 413, 422, 429), reply.text
    assert reply.json()["error"]["message"]


_FUZZ_GW: GatewayServer | None = None


def teardown_module() -> None:
    if _FUZZ_GW is not None:
        _FUZZ_GW.__exit__(None, None, None)
