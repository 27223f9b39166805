"""The protocol clients on a real Redis Cluster (3 masters, 3 replicas on loopback): the
three-step enqueue with WAIT, sharded pub/sub through the gateway's hub (one connection per
master), a master killed under followed streams, and the cluster's bad inputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from protocol.aclient import AsyncFerryClient
from protocol.client import FerryClient
from protocol.cluster.keys import ClusterKeys
from protocol.cluster.nodes import NotReplicatedError, Replication, check_cluster_url
from protocol.codec import decode_entry
from protocol.models import GenerateRequest, TokenEvent
from protocol.store import DuplicateRequestError, Ttls, as_str, ensure_group, push_event
from protocol.tenants import fair
from tests.redis_cluster import LocalCluster

KEYS, TTLS = ClusterKeys("ferry", 3), Ttls()


def _push(rc: RedisCluster, event: TokenEvent) -> None:
    pipe = rc.pipeline(transaction=True)  # one slot: MULTI/EXEC on its master
    push_event(pipe, KEYS, event, TTLS)
    pipe.execute()


@pytest.fixture
def client(redis_cluster: LocalCluster, cluster_client: RedisCluster
           ) -> Iterator[FerryClient]:
    c = FerryClient.from_url(redis_cluster.url, cluster=True, shards=3)
    c.ensure_group()
    yield c
    c.close()


def test_enqueue_lands_on_its_shard_after_a_replica_has_it(client: FerryClient,
                                                            redis_cluster: LocalCluster
                                                            ) -> None:
    rc = client.redis
    ids = [f"{i:032x}" for i in range(60)]
    for i, rid in enumerate(ids):
        client.enqueue(GenerateRequest(request_id=rid, prompt="p", priority=i % 3 - 1))
    for i, rid in enumerate(ids):
        job = {as_str(k): as_str(v) for k, v in rc.hgetall(KEYS.job(rid)).items()}
        assert job["state"] == "queued" and job["stream"] == KEYS.stream_for(rid, i % 3 - 1)
        assert "entry_id" not in job  # named by the worker that pulls it
        assert 3600 < rc.ttl(KEYS.job(rid)) <= TTLS.job_s  # the reservation got the job's TTL
    with pytest.raises(DuplicateRequestError, match="already in use"):
        client.enqueue(GenerateRequest(request_id=ids[0], prompt="again"))
    # keys spread over every master, streams over every shard
    per_master = {port: 0 for port in redis_cluster.masters()}
    for rid in ids:
        per_master[redis_cluster.master_of(KEYS.job(rid))] += 1
    assert min(per_master.values()) > 5
    assert all(rc.xlen(fair.bell(s)) > 0 for s in KEYS.lane_streams("normal"))
    pulled = set()  # every request waits in its shard's fair backlog, pulled like a worker
    for stream in KEYS.request_streams:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: the client made it
            rc.xgroup_create(stream, KEYS.group, id="0", mkstream=True)
        node = rc.get_node_from_key(stream)
        entries, _marks = fair.pull(rc.get_redis_connection(node), stream, KEYS.group, "w", 99)
        pulled |= {decode_entry(fields).request_id for _id, fields in entries}
    assert pulled == set(ids)


def test_no_replica_acknowledging_is_a_clear_error(redis_cluster: LocalCluster,
                                                   cluster_client: RedisCluster
                                                   ) -> None:
    strict = FerryClient.from_url(redis_cluster.url, cluster=True,
                                  replication=Replication(replicas=2, timeout_ms=50))
    try:
        with pytest.raises(NotReplicatedError, match=r"1 of 2 replica\(s\) acknowledged"):
            strict.enqueue(GenerateRequest(request_id="lonely", prompt="p"))
    finally:
        strict.close()
    with pytest.raises(ValueError, match="only database 0"):
        check_cluster_url(redis_cluster.url.replace("/0", "/3"))
    with pytest.raises(ValueError, match="replicas"):
        Replication(replicas=-1)


def test_sync_stream_and_queued_cancel_use_sharded_channels(client: FerryClient) -> None:
    rc = client.redis
    with client.subscribe("s1") as sub:
        client.enqueue(GenerateRequest(request_id="s1", prompt="p"))
        channels = rc.execute_command("PUBSUB SHARDCHANNELS", target_nodes=RedisCluster.PRIMARIES)
        _push(rc, TokenEvent(request_id="s1", seq=0, text="a"))
        _push(rc, TokenEvent(request_id="s1", seq=1, text="b", finish_reason="stop"))
        events = list(sub.events(timeout=10))
    assert KEYS.tokens("s1").encode() in channels
    assert [e.text for e in events] == ["a", "b"]
    with client.subscribe("c1") as sub:
        client.enqueue(GenerateRequest(request_id="c1", prompt="p"))
        assert client.cancel("c1", "changed my mind") == "cancelled"
        final = list(sub.events(timeout=10))
    assert [e.finish_reason for e in final] == ["cancelled"]


def _pubsub_clients(redis_cluster: LocalCluster) -> dict[int, int]:
    out = {}
    for port in redis_cluster.masters():
        with contextlib.closing(redis_cluster.node(port)) as r:
            out[port] = sum(1 for c in r.client_list() if int(c.get("ssub", 0)) > 0)
    return out


def test_the_hub_holds_one_connection_per_master_and_follows_a_failover(
    redis_cluster: LocalCluster, cluster_client: RedisCluster
) -> None:
    ids = [f"hub-{i}" for i in range(45)]

    async def scenario() -> tuple[dict[int, int], list[str], list[str], float]:
        client = AsyncFerryClient.from_url(redis_cluster.url, cluster=True,
                                           poll_interval_s=0.2)
        subs = {rid: await client.subscribe(rid).open() for rid in ids}
        for sub in subs.values():
            await sub.next_events(0)  # the initial (empty) backfill
        connections = await asyncio.to_thread(_pubsub_clients, redis_cluster)
        for rid in ids:
            await asyncio.to_thread(_push, cluster_client, TokenEvent(request_id=rid, seq=0,
                                                                       text=rid))
        before = [e.text for rid in ids for e in await subs[rid].next_events(5.0)]
        victim = redis_cluster.master_of(KEYS.tokens(ids[0]))
        redis_cluster.kill(victim)
        promoted = await asyncio.to_thread(redis_cluster.wait_promoted, victim)
        for rid in ids:
            await asyncio.to_thread(_push_retrying, cluster_client,
                                    TokenEvent(request_id=rid, seq=1, text=rid + "!",
                                               finish_reason="stop"))
        after = [e.text for rid in ids for e in await _until_final(subs[rid])]
        for sub in subs.values():
            await sub.close()
        await client.aclose()
        return connections, before, after, promoted

    try:
        connections, before, after, promoted = asyncio.run(scenario())
    finally:
        for port in redis_cluster.ports:
            if port not in redis_cluster.live_ports:
                redis_cluster.restart(port)
    assert list(connections.values()) == [1, 1, 1]  # every master, one connection each
    assert before == ids
    assert after == [rid + "!" for rid in ids]
    assert promoted < 15


def _push_retrying(rc: RedisCluster, event: TokenEvent) -> None:
    for _ in range(50):
        with contextlib.suppress(Exception):
            return _push(rc, event)
        rc.nodes_manager.initialize()
    _push(rc, event)


async def _until_final(sub: Any) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    while not sub.finished:
        events += await sub.next_events(10.0)
    return events


def test_groups_exist_on_every_shard(client: FerryClient) -> None:
    ensure_group(client.redis, KEYS)  # idempotent
    for stream in KEYS.request_streams:
        groups = client.redis.xinfo_groups(stream)
        assert [as_str(g["name"]) for g in groups] == [KEYS.group]


def test_a_sync_stream_follows_its_channel_to_the_promoted_replica(
    redis_cluster: LocalCluster, cluster_client: RedisCluster
) -> None:
    client = FerryClient.from_url(redis_cluster.url, cluster=True, poll_interval_s=0.2,
                                  reconnect_timeout_s=30)
    rid = "sync-failover"
    victim = redis_cluster.master_of(KEYS.tokens(rid))
    try:
        with client.subscribe(rid) as sub:
            _push(cluster_client, TokenEvent(request_id=rid, seq=0, text="a"))
            first = sub.next_events(5.0)
            redis_cluster.kill(victim)
            redis_cluster.wait_promoted(victim)
            _push_retrying(cluster_client, TokenEvent(request_id=rid, seq=1, text="b"))
            _push_retrying(cluster_client, TokenEvent(request_id=rid, seq=2, text="c",
                                                      finish_reason="stop"))
            rest = list(sub.events(timeout=30))
    finally:
        client.close()
        redis_cluster.restart(victim)
    assert [e.text for e in first + rest] == ["a", "b", "c"]
