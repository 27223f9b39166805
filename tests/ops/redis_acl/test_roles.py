"""ops/redis/users.acl against a real redis-server: each role can do its job and no more.

The gateway role runs the real async client (subscribe, enqueue, stream, cancel, queue lag,
live workers); the worker role runs the protocol's worker helpers through the scripted
worker of the protocol tests; the monitor role runs ``ferry top``'s collector. Then each
role is refused the commands it must not have.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from redis.exceptions import NoPermissionError, ResponseError

from ferry.fleet import collect
from ferry.recovery import RestartRecord
from protocol.aclient import AsyncFerryClient
from protocol.affinity.board import queue_advertise
from protocol.keys import Keys
from protocol.models import GenerateRequest, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, remove_heartbeat, write_heartbeat
from protocol.tenants import fair
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import free_port
from worker.service.redis.leases import hand_back_consumer

ACL = Path(__file__).resolve().parents[2] / "ops" / "redis" / "users.acl"
KEYS = Keys()
DENIED = "(?i)noperm|permission|can.t access"


class AclRedis:
    """A redis-server loading the ACL file; ``url(user)`` logs in with its placeholder password."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--dir", str(tmp), "--aclfile", str(ACL), "--logfile", "redis.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.log = tmp / "redis.log"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url("ferry-admin")).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(self.log.read_text() if self.log.exists() else "") from None
                time.sleep(0.05)

    def url(self, user: str) -> str:
        role = user.removeprefix("ferry-")
        return f"redis://{user}:change-me-{role}@127.0.0.1:{self.port}/0"

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    srv = AclRedis(tmp_path_factory.mktemp("acl"))
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _clean(server: AclRedis) -> None:
    server.client("ferry-admin").flushall()


def _denied(call: object, *args: object, **kwargs: object) -> None:
    with pytest.raises((NoPermissionError, ResponseError), match=DENIED):
        call(*args, **kwargs)  # type: ignore[operator]


def test_default_user_cannot_connect(server: AclRedis) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()


async def _gateway_round_trip(url: str) -> tuple[list[str], str, str, int, int]:
    client = AsyncFerryClient(aredis.Redis.from_url(url), poll_interval_s=0.2)
    try:
        await client.ensure_group()
        assert await client.ping()
        status = await client.generate(GenerateRequest(prompt="hi"), timeout=20)
        texts = [status.text]
        lag = await client.queue_lag()
        workers = len(await client.live_workers())
        # The job hash and the replay log are readable, and a finished job cannot be cancelled.
        assert (await client.result(status.request_id)) is not None
        events = [e.seq async for e in client.stream(status.request_id, timeout=5)]
        texts.append(str(len(events)))
        too_late = await client.cancel(status.request_id)
        return texts, status.finish_reason or "", too_late, lag, workers
    finally:
        await client.aclose()


def test_gateway_and_worker_serve_a_request(server: AclRedis) -> None:
    with FakeWorker(server.url("ferry-worker"), Script(tokens=["a", "b", "c"])):
        texts, reason, too_late, lag, workers = asyncio.run(
            _gateway_round_trip(server.url("ferry-gateway"))
        )
    assert texts == ["abc", "3"]
    assert (reason, too_late, lag, workers) == ("stop", "done", 0, 1)


async def _cancel_queued(url: str) -> tuple[str, str | None]:
    client = AsyncFerryClient(aredis.Redis.from_url(url), poll_interval_s=0.2)
    try:
        request = GenerateRequest(prompt="never runs")
        async with client.subscribe(request.request_id) as sub:
            await client.enqueue(request)
            state = await client.cancel(request.request_id, "test")
            events = [e async for e in sub.events(timeout=5)]
        return state, events[-1].finish_reason
    finally:
        await client.aclose()


def test_gateway_cancels_a_queued_job(server: AclRedis) -> None:
    assert asyncio.run(_cancel_queued(server.url("ferry-gateway"))) == ("cancelled", "cancelled")


def test_worker_recovery_commands_and_dead_letters(server: AclRedis) -> None:
    r = server.client("ferry-worker")
    ensure_group(r, KEYS)
    admin = server.client("ferry-admin")
    admin.xadd(KEYS.requests, {"data": b"not msgpack"})
    r.xreadgroup(KEYS.group, "w-dead", {KEYS.requests: ">"}, count=1)
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 1
    claimed = r.xautoclaim(KEYS.requests, KEYS.group, "w2", min_idle_time=0, start_id="0-0")
    entry_id = claimed[1][0][0]
    r.xclaim(KEYS.requests, KEYS.group, "w3", min_idle_time=0, message_ids=[entry_id])
    r.xinfo_groups(KEYS.requests)
    r.xlen(KEYS.requests)
    r.xgroup_delconsumer(KEYS.requests, KEYS.group, "w-dead")
    with FakeWorker(server.url("ferry-worker")) as worker:  # reads the rest, dead-letters
        admin.xadd(KEYS.requests, {"data": b"\xc1"})
        deadline = time.monotonic() + 10
        while not worker.dead and time.monotonic() < deadline:
            time.sleep(0.05)
    assert worker.dead and admin.xlen(KEYS.dead_letter) == 1
    # a dead consumer's entries handed back, and the fleet's counter bumped and read
    assert hand_back_consumer(r, KEYS, "w3") == 1
    assert r.get(KEYS.handbacks) == b"1"
    r.xack(KEYS.requests, KEYS.group, entry_id)
    r.xdel(KEYS.requests, entry_id)
    with r.pubsub() as pubsub:
        pubsub.subscribe(KEYS.control)
    beat = WorkerHeartbeat(worker_id="w1", model="m", started_at=1.0, updated_at=1.0)
    pipe = r.pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls())
    remove_heartbeat(pipe, KEYS, "w1")
    pipe.execute()


async def _gateway_lora(url: str) -> tuple[str, str, list[str], bool]:
    from protocol.lora.registry import (
        LoraRecord,
        aread_adapter_models,
        aread_adapters,
        aregister_adapter,
        aunregister_adapter,
    )

    r = aredis.Redis.from_url(url)
    try:
        record = LoraRecord(name="t::sql", path="/lora/sql", parent="m", owner="t")
        added = await aregister_adapter(r, KEYS, record, limit=2)
        replaced = await aregister_adapter(r, KEYS, record, limit=2, replace=True)
        assert set(await aread_adapters(r, KEYS, "m")) == {"t::sql"}
        models = await aread_adapter_models(r, KEYS)
        return added, replaced, models, await aunregister_adapter(r, KEYS, "m", "t::sql")
    finally:
        await r.aclose()


def test_gateway_and_worker_keep_the_lora_registry(server: AclRedis) -> None:
    """The gateway registers through its script (count, add or replace) and the models'
    set; the worker publishes the adapters it starts with and reads the registry."""
    from protocol.lora.registry import LoraRecord, read_adapters, register_adapter

    assert asyncio.run(_gateway_lora(server.url("ferry-gateway"))) == (
        "added", "replaced", ["m"], True)
    worker = server.client("ferry-worker")
    assert register_adapter(worker, KEYS, LoraRecord(name="sql", path="/lora/sql",
                                                     parent="m", source="modules"))
    assert set(read_adapters(worker, KEYS, "m")) == {"sql"}
    _denied(worker.hdel, KEYS.lora_adapters("m"), "sql")  # a worker unloads nothing


def test_worker_is_refused_what_it_must_not_do(server: AclRedis) -> None:
    r = server.client("ferry-worker")
    # (it XADDs to the lanes now: the fair pull, run by the worker, moves entries in)
    _denied(r.hset, "ferry:tenant:{t}:inflight", "x", "1")  # cannot touch quotas
    _denied(r.delete, KEYS.requests)
    _denied(r.delete, fair.backlog(KEYS.requests, "t"))
    _denied(r.set, KEYS.cancelled("x"), "reason")
    _denied(r.publish, KEYS.control, b"x")
    _denied(r.flushall)
    _denied(r.keys, "*")
    _denied(r.config_get, "*")
    _denied(r.set, "other:key", "1")


def test_gateway_is_refused_what_it_must_not_do(server: AclRedis) -> None:
    ensure_group(server.client("ferry-admin"), KEYS)
    r = server.client("ferry-gateway")
    _denied(r.xreadgroup, KEYS.group, "g", {KEYS.requests: ">"})
    _denied(r.xack, KEYS.requests, KEYS.group, "0-1")
    _denied(r.delete, KEYS.requests)
    _denied(r.xtrim, KEYS.requests, maxlen=0)
    _denied(r.set, KEYS.worker("fake"), b"x")
    _denied(r.sadd, KEYS.workers, "fake")
    _denied(r.set, KEYS.events("x"), b"x")  # only list commands on the replay log
    _denied(r.flushall)
    _denied(r.keys, "*")
    _denied(r.eval, "return redis.call('DEL', KEYS[1])", 1, KEYS.requests)  # scripts too
    with r.pubsub() as pubsub:  # the refusal arrives as the reply to SUBSCRIBE
        pubsub.subscribe("other-channel")
        _denied(pubsub.get_message, timeout=2)


def test_monitor_reads_for_ferry_top_but_writes_nothing(server: AclRedis) -> None:
    admin = server.client("ferry-admin")
    ensure_group(admin, KEYS)
    beat = WorkerHeartbeat(worker_id="w1", model="m", started_at=1.0, updated_at=time.time())
    pipe = admin.pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls())
    pipe.execute()
    record = RestartRecord("worker-0", 1, -9, time.time(), "w1", crash_loop=False)
    admin.hset(KEYS.restarts, "up-1/worker-0", record.encode())  # what `ferry up` writes
    r = server.client("ferry-monitor")
    snapshot = collect(r, KEYS)
    assert [w.worker_id for w in snapshot.workers] == ["w1"]
    assert snapshot.restarts == [record]
    assert snapshot.queue.group_exists
    r.xpending(KEYS.requests, KEYS.group)
    _denied(r.srem, KEYS.workers, "w1")
    _denied(r.xadd, KEYS.requests, {"data": b"x"})
    _denied(r.set, KEYS.worker("w1"), b"x")


def test_real_gateway_http_api_as_gateway_user(server: AclRedis) -> None:
    """The HTTP gateway itself (startup XGROUP, readiness, jobs API, SSE) as ferry-gateway."""
    import httpx

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer

    settings = GatewaySettings(redis_url=server.url("ferry-gateway"), poll_interval_s=0.2)
    with FakeWorker(server.url("ferry-worker"), Script(tokens=["x", "y"])), \
            GatewayServer(settings) as gw:
        assert httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 200
        reply = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, timeout=10)
        assert reply.status_code == 202, reply.text
        job_id = reply.json()["id"]
        sse = httpx.get(f"{gw.url}/v1/jobs/{job_id}/events", timeout=10)
        assert sse.status_code == 200 and '"finish_reason":"stop"' in sse.text.replace(" ", "")
        assert httpx.get(f"{gw.url}/v1/jobs/{job_id}", timeout=10).json()["state"] == "done"
        assert httpx.get(f"{gw.url}/v1/models", timeout=10).status_code == 200
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert "ferry_gateway_requests_total" in metrics


def test_tenants_and_quotas_as_gateway_user(server: AclRedis, tmp_path: Path) -> None:
    """FERRY_API_KEYS tenants (the naming secret: GET/SET ``ferry:tenant:naming-secret``)
    and a tenants file's quotas (the admission scripts, the in-flight sweep) as
    ferry-gateway, with /metrics behind its key."""
    import hashlib

    import httpx

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer

    url = server.url("ferry-gateway")
    keyed = GatewaySettings(redis_url=url, api_keys=("k1",), metrics_key="m")
    with GatewayServer(keyed) as gw:
        reply = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, timeout=10,
                           headers={"Authorization": "Bearer k1"})
        assert reply.status_code == 202, reply.text
        metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer m"})
        assert 'ferry_gateway_tenant_requests_total{tenant="key-' in metrics.text
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.t]\nkeys_sha256 = ["{hashlib.sha256(b"k2").hexdigest()}"]\n'
                    "max_concurrent = 1\ntokens_per_minute = 1000\n")
    with GatewayServer(GatewaySettings(redis_url=url, tenants_file=str(path))) as gw:
        who = {"Authorization": "Bearer k2"}
        first = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert first.status_code == 202, first.text
        full = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert full.status_code == 429 and "max_concurrent" in full.text  # after a sweep
        job = first.json()["id"]
        assert httpx.delete(f"{gw.url}/v1/jobs/{job}", headers=who).status_code == 202
        again = httpx.post(f"{gw.url}/v1/jobs", json={"prompt": "p"}, headers=who, timeout=10)
        assert again.status_code == 202, again.text  # the sweep dropped the cancelled job


def test_batch_api_as_gateway_batcher_and_worker_users(server: AclRedis) -> None:
    """Files and batches over HTTP as ferry-gateway, a batcher as ferry-batcher, a worker as
    ferry-worker: upload, a batch run to its end (with a bad line), the output and error
    files, a cancel, deletes; then what the batcher and the gateway may not do."""
    import io
    import json

    import openai

    from gateway.settings import GatewaySettings
    from tests.gateway.batcher_thread import BatcherThread
    from tests.gateway.server import GatewayServer

    common = {"poll_interval_s": 0.2, "batch_poll_interval_s": 0.05}
    gateway = GatewaySettings(redis_url=server.url("ferry-gateway"), **common)
    batcher = GatewaySettings(redis_url=server.url("ferry-batcher"), **common)
    body = {"prompt": "p", "max_tokens": 4}
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": body}) for i in range(3)] + ["{bad"]
    with FakeWorker(server.url("ferry-worker"), Script(tokens=["x", "y"])), \
            GatewayServer(gateway) as gw, BatcherThread(batcher, "acl-batcher"):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
        source = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 30
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.05)
        assert done.request_counts.completed == 3 and done.request_counts.failed == 1
        assert len(client.files.content(done.output_file_id).text.splitlines()) == 3
        assert [f.id for f in client.batches.list().data] == [batch.id]
        assert len(client.files.list().data) == 3  # the input, output and error files
        other = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                      completion_window="24h")
        assert client.batches.cancel(other.id).status == "cancelling"
        client.files.delete(done.output_file_id)
        client.files.delete(source.id)
    r, g = server.client("ferry-batcher"), server.client("ferry-gateway")
    ensure_group(server.client("ferry-admin"), KEYS)
    _denied(r.xreadgroup, KEYS.group, "b", {KEYS.requests: ">"})
    _denied(r.delete, KEYS.requests)
    _denied(r.set, KEYS.worker("fake"), b"x")
    _denied(r.flushall)
    _denied(r.keys, "*")
    _denied(g.sadd, KEYS.batch_inflight(batch.id), 1)  # progress is the batcher's
    _denied(g.hincrby, KEYS.batch(batch.id), "completed", 1)
    _denied(g.set, KEYS.batch_lease(batch.id), "me")


def test_tokenizer_routes_as_gateway_and_worker_users(server: AclRedis) -> None:
    """/tokenize as ferry-gateway, answered by the worker's tokenizer responder as
    ferry-worker (the default model's real tokenizer, no model loaded); neither may touch
    the other's side beyond that."""
    import httpx
    from transformers import AutoTokenizer

    from gateway.settings import GatewaySettings
    from tests.gateway.server import GatewayServer
    from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
    from worker.models import default_model_path
    from worker.service.redis.connection import WorkerSettings
    from worker.service.sidecars.tokenizer_responder import TokenizerResponder

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    prompts = PromptBuilder(tokenizer, PromptLimits(vocab_size=len(tokenizer),
                                                    max_model_len=2048, num_blocks=8,
                                                    block_size=16))
    worker = WorkerSettings(redis_url=server.url("ferry-worker"), worker_id="acl-tok",
                            model_name="m")
    beat = WorkerHeartbeat(worker_id="acl-tok", model="m", started_at=1.0,
                           updated_at=time.time())
    pipe = server.client("ferry-worker").pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=60))
    pipe.execute()
    responder = TokenizerResponder(worker, prompts, tokenizer, threads=1)
    responder.start()
    settings = GatewaySettings(redis_url=server.url("ferry-gateway"))
    try:
        with GatewayServer(settings) as gw:
            reply = httpx.post(f"{gw.url}/tokenize", json={"prompt": "hello"}, timeout=20)
            assert reply.status_code == 200, reply.text
            assert reply.json()["tokens"] == tokenizer("hello")["input_ids"]
            info = httpx.get(f"{gw.url}/tokenizer_info", timeout=20)
            assert info.json()["eos_token"] == tokenizer.eos_token
    finally:
        responder.stop()
    g, w = server.client("ferry-gateway"), server.client("ferry-worker")
    _denied(g.blpop, [KEYS.tokenizer_requests("m")], 1)  # only replies are the gateway's
    _denied(g.set, KEYS.tokenizer_requests("m"), b"x")
    _denied(w.lrem, KEYS.tokenizer_requests("m"), 1, b"x")
    _denied(w.set, KEYS.tokenizer_reply("m", "r"), b"x")


def test_affinity_board_written_by_workers_read_by_producers(server: AclRedis) -> None:
    """A worker advertises, trims, expires and drops its prefix board; the gateway and the
    batcher read it (ZMSCORE) and can change none of it."""
    key = KEYS.affinity("w1")
    worker = server.client("ferry-worker")
    pipe = worker.pipeline(transaction=False)
    queue_advertise(pipe, key, {"h1": 1.0, "h2": 2.0}, removed=["h0"], ttl_ms=5000, cap=4)
    pipe.execute()
    for user in ("ferry-gateway", "ferry-batcher"):
        producer = server.client(user)
        assert producer.zmscore(key, ["h1", "h2", "h3"]) == [1.0, 2.0, None]
        _denied(producer.zadd, key, {"h9": 9.0})
        _denied(producer.delete, key)
    worker.delete(key)
    assert server.client("ferry-gateway").zmscore(key, ["h1"]) == [None]
