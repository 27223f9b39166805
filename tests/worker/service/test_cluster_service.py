"""The service's core scenarios on a Redis Cluster (3 masters, 3 replicas on loopback), with
two real ``ferry worker --redis-cluster`` processes and the gateway in cluster mode:
streaming through the openai client, the jobs API (follow, resume, cancel), deadlines,
the priority lanes across shards, and dead letters in their shard. Outputs are compared
with the in-process engine running each request alone.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgpack
import openai
import pytest
from rich.console import Console

from gateway.settings import GatewaySettings
from protocol.client import FerryClient
from protocol.cluster.keys import ClusterKeys
from protocol.codec import decode_event, status_from_hash
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.gateway.server import GatewayServer
from tests.gateway.test_gateway_jobs import _events as sse_events
from tests.redis_cluster import LocalCluster
from tests.worker.service.procs import WorkerProcess, assert_contiguous, start_all

KEYS = ClusterKeys("ferry", 3)
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def stack(redis_cluster: LocalCluster, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    workers = [WorkerProcess(checkpoint, redis_cluster.url, w, log_dir, "--lease-s", "2",
                             cluster=True, env={"FERRY_MAX_NUM_SEQS": str(MAX_NUM_SEQS)})
               for w in ("cs1", "cs2")]
    client = FerryClient.from_url(redis_cluster.url, cluster=True)
    try:
        start_all(*workers)
        settings = GatewaySettings(redis_url=redis_cluster.url, redis_cluster=True,
                                   keepalive_s=0.5)
        with GatewayServer(settings) as gateway:
            yield SimpleNamespace(url=gateway.url, client=client, r=client.redis,
                                  workers=workers)
    finally:
        for w in workers:
            w.kill()
        client.close()


def test_openai_streams_equal_solo_runs(stack: Any, reference: Any) -> None:
    """Half greedy, half seeded; requests spread over every shard; each equals its solo
    run, and every master holds some of their keys."""
    api = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    model = api.models.list().data[0].id
    jobs = [dict(prompt=f"def f{i}(x):", max_tokens=24 + 3 * i,
                 temperature=0.0 if i % 2 else 1.0, seed=None if i % 2 else 500 + i)
            for i in range(10)]
    texts: dict[int, str] = {}

    def run(i: int) -> None:
        chunks = api.completions.create(model=model, stream=True,
                                        extra_body={"ignore_eos": True}, **jobs[i])
        texts[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, job in enumerate(jobs):
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=job["temperature"],
                                seed=job["seed"], ignore_eos=True)
        assert texts[i] == reference.run(job["prompt"], params)[1], i


def _wait(stack: Any, job_id: str, states: tuple[str, ...], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = httpx.get(f"{stack.url}/v1/jobs/{job_id}").json()
        if body.get("state") in states:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.05)


def test_jobs_api_follow_resume_and_result(stack: Any, reference: Any) -> None:
    body = {"request_id": "cl-job-1", "prompt": "import os",
            "params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}
    created = httpx.post(f"{stack.url}/v1/jobs", json=body)
    assert created.status_code == 202 and created.json()["id"] == "cl-job-1"
    events = sse_events(httpx.get(f"{stack.url}/v1/jobs/cl-job-1/events", timeout=60).text)
    assert [seq for seq, _ in events] == list(range(len(events)))
    assert events[-1][1]["finish_reason"] == "length"
    resumed = httpx.get(f"{stack.url}/v1/jobs/cl-job-1/events", timeout=60,
                        headers={"Last-Event-ID": "2"})
    assert [seq for seq, _ in sse_events(resumed.text)] == list(range(3, len(events)))
    status = _wait(stack, "cl-job-1", ("done",))
    ids, text = reference.run("import os", SamplingParams(max_tokens=6, temperature=0,
                                                          ignore_eos=True))
    assert status["text"] == text and status["token_ids"] == ids
    dup = httpx.post(f"{stack.url}/v1/jobs", json=body)
    assert dup.status_code == 409 and dup.json()["error"]["param"] == "request_id"


def test_cancel_and_deadlines(stack: Any) -> None:
    long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
    httpx.post(f"{stack.url}/v1/jobs", json={"request_id": "cl-cancel", "prompt": "x",
                                             "params": long}).raise_for_status()
    _wait(stack, "cl-cancel", ("running",))
    while stack.r.llen(KEYS.events("cl-cancel")) < 2:
        time.sleep(0.02)
    deleted = httpx.delete(f"{stack.url}/v1/jobs/cl-cancel")
    assert deleted.status_code == 202 and deleted.json()["state"] == "cancelling"
    assert _wait(stack, "cl-cancel", ("cancelled",))["finish_reason"] == "cancelled"
    final = decode_event(stack.r.lindex(KEYS.events("cl-cancel"), -1))
    assert final.finish_reason == "cancelled" and final.error

    params = SamplingParams(**long)
    # how long 400 tokens take on this stack (the lean CPU decode runs this tiny model at
    # ~1 ms a token: a fixed half second let "slow" finish first); "slow" gets a quarter
    # of that, so a loaded machine that slows the probe more than "slow" cannot flip it
    probe = GenerateRequest(prompt="probe", params=params)
    start = time.time()
    stack.client.enqueue(probe)
    assert list(stack.client.stream(probe.request_id, timeout=60))[-1].finish_reason == "length"
    window = (time.time() - start) / 4
    now = time.time()
    expired = GenerateRequest(prompt="late", params=params, created_at=now - 10, timeout_s=5)
    running = GenerateRequest(prompt="slow", params=params, created_at=now + window - 10,
                              timeout_s=10)
    for request in (expired, running):
        stack.client.enqueue(request)
    for request in (expired, running):
        events = list(stack.client.stream(request.request_id, timeout=60))
        assert_contiguous(events)
        assert events[-1].finish_reason == "timeout", request.prompt
        assert 0 < len(events) < 400


def _ids_per_shard(per_shard: int) -> list[str]:
    """Request ids, ``per_shard`` on every shard (random ids leave a shard empty 2% of
    the time with 12 requests over 3 shards)."""
    ids: dict[int, list[str]] = {}
    for i in range(10_000):
        rid = f"queued-{i}"
        picked = ids.setdefault(KEYS.shard_of_stream(KEYS.stream_for(rid, 10)), [])
        if len(picked) < per_shard:
            picked.append(rid)
    assert all(len(picked) == per_shard for picked in ids.values())
    return [rid for picked in ids.values() for rid in picked]


def test_the_high_lane_is_read_first_over_every_shard(stack: Any) -> None:
    """Both workers full with long requests; 12 wait at priority 10 on every shard; one at
    -100 arrives last, on whichever shard its id picks: it starts before all 12. The
    workers are paused (SIGSTOP) while the 13 are enqueued, so no slot frees between the
    first and the last (a long request on the tiny model ends within a second), and the
    long requests hold their slots until cancelled, after the urgent one ended."""
    client, r = stack.client, stack.r
    long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    running = [GenerateRequest(prompt=f"def g{i}():", params=long)
               for i in range(2 * MAX_NUM_SEQS)]
    queued = [GenerateRequest(request_id=rid, prompt=f"import m{i}", params=short,
                              priority=10) for i, rid in enumerate(_ids_per_shard(4))]
    urgent = GenerateRequest(prompt="class Urgent:", params=short, priority=-100)
    for request in running:
        client.enqueue(request)
    deadline = time.monotonic() + 60
    while not all(r.hget(KEYS.job(q.request_id), "state") == b"running" for q in running):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for worker in stack.workers:
        worker.send(signal.SIGSTOP)
    try:
        for request in [*queued, urgent]:
            client.enqueue(request)
    finally:
        for worker in stack.workers:
            worker.send(signal.SIGCONT)
    assert {KEYS.shard_of_stream(KEYS.stream_for(q.request_id, 10)) for q in queued} == {0, 1, 2}
    assert list(client.stream(urgent.request_id, timeout=120))[-1].is_final
    assert all(r.hget(KEYS.job(q.request_id), "state") == b"running" for q in running)
    for q in running:
        client.cancel(q.request_id)
    for q in [*queued, *running]:
        assert list(client.stream(q.request_id, timeout=120))[-1].is_final
    started = {q.request_id: status_from_hash(r.hgetall(KEYS.job(q.request_id))).started_at
               for q in [urgent, *queued]}
    assert min(started, key=lambda rid: started[rid] or 0) == urgent.request_id


def test_a_bad_entry_is_dead_lettered_in_its_shard(stack: Any) -> None:
    r = stack.r
    stream = KEYS.shard_streams(2)[1]
    bad = msgpack.packb({"version": 2, "request_id": "cl-bad", "prompt": "x",
                         "params": {"max_tokens": "many"}})
    with stack.client.subscribe("cl-bad") as sub:
        r.xadd(stream, {"data": bad})
        events = list(sub.events(timeout=30))
    assert events[-1].finish_reason == "error" and events[-1].error_kind == "invalid_request"
    assert "params.max_tokens" in (events[-1].error or "")
    deadline = time.monotonic() + 10  # the record follows the event (another slot)
    while not (dead := r.xrange(KEYS.dead_letter_for(stream))):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert [row[1][b"stream"].decode() for row in dead] == [stream]
    assert r.xlen(stream) == 0  # acknowledged and deleted


def test_ferry_top_sees_the_fleet_and_where_each_shard_lives(stack: Any,
                                                             redis_cluster: LocalCluster) -> None:
    from ferry.commands.top import render
    from ferry.fleet import collect

    snap = collect(stack.r, KEYS)
    assert sorted(w.worker_id for w in snap.workers) == ["cs1", "cs2"]
    assert [s.shard for s in snap.shards] == [0, 1, 2]
    assert {int(s.node.rsplit(":", 1)[1]) for s in snap.shards} == set(redis_cluster.masters())
    console = Console(width=140, record=True)
    console.print(render(snap))
    frame = console.export_text()
    assert "shards" in frame and all(f"@{s.node}" in frame for s in snap.shards)


def test_a_request_no_replica_confirmed_is_refused_and_cancelled(
    stack: Any, redis_cluster: LocalCluster
) -> None:
    """Asking for two replicas where each master has one: WAIT counts one, so the gateway
    answers 503 naming the reason, and the request, on its master but not accepted, is
    cancelled (a worker that took it in the meantime stops it)."""
    settings = GatewaySettings(redis_url=redis_cluster.url, redis_cluster=True,
                               redis_wait_replicas=2, redis_wait_timeout_ms=100)
    body = {"request_id": "cl-unsafe", "prompt": "x",
            "params": {"max_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with GatewayServer(settings) as strict:
        reply = httpx.post(f"{strict.url}/v1/jobs", json=body)
    assert reply.status_code == 503, reply.text
    assert "1 of 2 replica(s) acknowledged" in reply.json()["error"]["message"]
    status = _wait(stack, "cl-unsafe", ("cancelled",))
    assert status["finish_reason"] == "cancelled" and "not accepted" in status["error"]
    assert len(status["token_ids"] or []) < 400


def test_tokenizer_routes_on_a_cluster(stack: Any, checkpoint: str) -> None:
    """/tokenize and /detokenize through the cluster gateway: the request and its reply
    share the model's slot, and whichever of the two workers is free answers."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = httpx.get(stack.url + "/v1/models").json()["data"][0]["id"]
    assert stack.r.keyslot(KEYS.tokenizer_requests(model)) == stack.r.keyslot(
        KEYS.tokenizer_reply(model, "any"))
    for text in ("def f(x):", "    return x * 2", "class Queue:"):
        got = httpx.post(stack.url + "/tokenize", json={"prompt": text}, timeout=30)
        assert got.status_code == 200, got.text
        ids = got.json()["tokens"]
        assert ids == tok(text)["input_ids"]
        back = httpx.post(stack.url + "/detokenize", json={"tokens": ids}, timeout=30)
        assert back.json() == {"prompt": tok.decode(ids)}
    info = httpx.get(stack.url + "/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == tok.chat_template
