"""ops/redis/users.acl against a real redis-server: each role can do its job and no more.

The gateway role runs the real async client (subscribe, enqueue, stream, cancel, queue lag,
live workers); the worker role runs the protocol's worker helpers through the scripted
worker of the protocol tests; the monitor role runs ``ferry top``'s collector. Then each
role is refused the commands it must not have.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aredis

from ferry.fleet import collect
from ferry.recovery import RestartRecord
from protocol.aclient import AsyncFerryClient
from protocol.affinity.board import queue_advertise
from protocol.models import GenerateRequest, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, remove_heartbeat, write_heartbeat
from protocol.tenants import fair
from tests.ops.redis_acl.acl_server import KEYS, AclRedis, denied
from tests.protocol.fake_worker import FakeWorker, Script
from worker.service.redis.leases import hand_back_consumer


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
    denied(worker.hdel, KEYS.lora_adapters("m"), "sql")  # a worker unloads nothing


def test_worker_is_refused_what_it_must_not_do(server: AclRedis) -> None:
    r = server.client("ferry-worker")
    # (it XADDs to the lanes now: the fair pull, run by the worker, moves entries in)
    denied(r.hset, "ferry:tenant:{t}:inflight", "x", "1")  # cannot touch quotas
    denied(r.delete, KEYS.requests)
    denied(r.delete, fair.backlog(KEYS.requests, "t"))
    denied(r.set, KEYS.cancelled("x"), "reason")
    denied(r.publish, KEYS.control, b"x")
    denied(r.flushall)
    denied(r.keys, "*")
    denied(r.config_get, "*")
    denied(r.set, "other:key", "1")


def test_gateway_is_refused_what_it_must_not_do(server: AclRedis) -> None:
    ensure_group(server.client("ferry-admin"), KEYS)
    r = server.client("ferry-gateway")
    denied(r.xreadgroup, KEYS.group, "g", {KEYS.requests: ">"})
    denied(r.xack, KEYS.requests, KEYS.group, "0-1")
    denied(r.delete, KEYS.requests)
    denied(r.xtrim, KEYS.requests, maxlen=0)
    denied(r.set, KEYS.worker("fake"), b"x")
    denied(r.sadd, KEYS.workers, "fake")
    denied(r.set, KEYS.events("x"), b"x")  # only list commands on the replay log
    denied(r.flushall)
    denied(r.keys, "*")
    denied(r.eval, "return redis.call('DEL', KEYS[1])", 1, KEYS.requests)  # scripts too
    with r.pubsub() as pubsub:  # the refusal arrives as the reply to SUBSCRIBE
        pubsub.subscribe("other-channel")
        denied(pubsub.get_message, timeout=2)


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
    denied(r.srem, KEYS.workers, "w1")
    denied(r.xadd, KEYS.requests, {"data": b"x"})
    denied(r.set, KEYS.worker("w1"), b"x")


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
        denied(producer.zadd, key, {"h9": 9.0})
        denied(producer.delete, key)
    worker.delete(key)
    assert server.client("ferry-gateway").zmscore(key, ["h1"]) == [None]
