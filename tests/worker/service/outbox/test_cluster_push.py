"""The cluster outbox (``ClusterPusher``) against a real Redis Cluster: the job-hash fence,
one call per master, a replay log repaired after losing its tail, and XACK only after a
replica has the terminal event."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

import pytest
from redis.crc import key_slot

from protocol.client import FerryClient
from protocol.cluster.nodes import Replication, refresh_topology
from protocol.codec import decode_entry, decode_event, encode_event
from protocol.models import GenerateRequest, JobStatus, TokenEvent, Usage
from protocol.store import as_str, start_job
from protocol.tenants import fair
from tests.redis_cluster import LocalCluster
from worker.service.jobs import Outgoing
from worker.service.outbox.cluster_push import ClusterPusher
from worker.service.outbox.thread import encode_outgoing
from worker.service.redis.connection import WorkerSettings

NEVER = threading.Event()


def _push(pusher: ClusterPusher, batch: list[Outgoing], *args: Any, **kw: Any) -> list[Any]:
    """The outcomes of ``batch``, in its order (every master answers here)."""
    settled = pusher.push(batch, *args, **kw)
    assert [out for out, _ in settled] == batch
    return [outcome for _, outcome in settled]


class Fleet:
    """Requests enqueued on the cluster and taken by worker ``w1`` (XREADGROUP, start_job)."""

    def __init__(self, cluster: LocalCluster, n: int, master: int | None = None) -> None:
        self.settings = WorkerSettings(redis_url=cluster.url, worker_id="w1",
                                       redis_cluster=True, replication=Replication(1, 200))
        self.keys = self.settings.keys
        self.client = FerryClient.from_url(cluster.url, cluster=True)
        self.client.ensure_group()
        self.r = self.client.redis
        ids = [f"push-{i}" for i in range(n * 8)]
        if master is not None:  # only requests whose keys that master holds
            ids = [rid for rid in ids
                   if int(self.r.get_node_from_key(self.keys.job(rid)).port) == master]
        ids = ids[:n]
        for rid in ids:
            self.client.enqueue(GenerateRequest(request_id=rid, prompt="x"))
        self.entries: dict[str, tuple[str, str]] = {}
        for stream in self.keys.request_streams:  # taken as a worker takes them: fair pull
            taken, _marks = fair.pull(self.r, stream, self.keys.group, "w1", len(ids))
            for raw_id, fields in taken:
                rid, entry_id = decode_entry(fields).request_id, as_str(raw_id)
                assert start_job(self.r, self.keys, rid, "w1", self.settings.ttls,
                                 entry_id=entry_id, stream=stream) == "run"
                self.entries[rid] = (stream, entry_id)
        assert sorted(self.entries) == sorted(ids)
        self.pusher = ClusterPusher(self.settings, self.r, encode_outgoing, lambda _: True)

    def step(self, seq: int) -> list[Outgoing]:
        return [Outgoing(entry, rid, seq, [seq + 1], f"t{seq}")
                for rid, entry in self.entries.items()]

    def final(self, rid: str, seq: int) -> Outgoing:
        usage = Usage(prompt_tokens=1, completion_tokens=seq, total_tokens=seq + 1)
        event = TokenEvent(request_id=rid, seq=seq, finish_reason="length", usage=usage)
        status = JobStatus(request_id=rid, state="done", finish_reason="length", usage=usage,
                           worker_id="w1")
        return Outgoing(self.entries[rid], rid, seq, [], "", event=event, status=status)

    def log(self, rid: str) -> list[TokenEvent]:
        return [decode_event(x) for x in self.r.lrange(self.keys.events(rid), 0, -1)]


@pytest.fixture
def fleet(redis_cluster: LocalCluster, cluster_client: Any) -> Fleet:
    return Fleet(redis_cluster, 12)


def test_steps_go_out_once_in_order_and_retries_are_dups(fleet: Fleet) -> None:
    for seq in range(3):
        assert set(_push(fleet.pusher, fleet.step(seq), NEVER)) == {"ok"}
    assert set(_push(fleet.pusher, fleet.step(2), NEVER)) == {"dup"}  # a resend
    for rid in fleet.entries:
        assert [(e.seq, e.text) for e in fleet.log(rid)] == [(0, "t0"), (1, "t1"), (2, "t2")]


def test_the_job_hash_fences_a_worker_whose_entry_was_taken(fleet: Fleet) -> None:
    rid = next(iter(fleet.entries))
    stream, entry_id = fleet.entries[rid]
    assert start_job(fleet.r, fleet.keys, rid, "w2", fleet.settings.ttls, entry_id=entry_id,
                     stream=stream) == "run"  # a reaper elsewhere took it over
    outcomes = dict(zip(fleet.entries, _push(fleet.pusher, fleet.step(0), NEVER), strict=True))
    assert outcomes.pop(rid) == "lost" and set(outcomes.values()) == {"ok"}
    assert fleet.log(rid) == []
    fleet.r.hset(fleet.keys.job(rid), mapping={"worker_id": "w1", "entry_id": "1-1"})
    mine = [out for out in fleet.step(0) if out.request_id == rid]
    assert _push(fleet.pusher, mine, NEVER) == ["foreign"]  # the job is another entry's


def test_a_lost_log_tail_is_sent_again_from_what_the_worker_kept(fleet: Fleet) -> None:
    for seq in range(5):
        _push(fleet.pusher, fleet.step(seq), NEVER)
    victim = next(iter(fleet.entries))
    fleet.r.ltrim(fleet.keys.events(victim), 0, 1)  # a failover lost seq 2..4
    assert set(_push(fleet.pusher, fleet.step(5), NEVER)) == {"ok"}
    assert [(e.seq, e.text) for e in fleet.log(victim)] == [(s, f"t{s}") for s in range(6)]
    forgetful = ClusterPusher(fleet.settings, fleet.r, encode_outgoing, lambda _: True)
    fleet.r.ltrim(fleet.keys.events(victim), 0, 1)
    outcomes = dict(zip(fleet.entries, _push(forgetful, fleet.step(6), NEVER), strict=True))
    assert outcomes[victim] == "gap"  # not this worker's events: resumed from the log


def _wait_replica_listed(cluster: LocalCluster, fleet: Fleet, batch: list[Outgoing]) -> None:
    """Until every node's slot map lists the replica: Redis leaves a replica out of CLUSTER
    SLOTS until gossip says it has synced data, and the pusher WAITs only for listed ones."""
    slot = key_slot(fleet.keys.job(batch[0].request_id).encode())
    deadline = time.monotonic() + 15
    while not all(_listed_replicas(cluster, port, slot) for port in cluster.live_ports):
        assert time.monotonic() < deadline, "the replica never showed in CLUSTER SLOTS"
        time.sleep(0.1)
    refresh_topology(fleet.r)


def _listed_replicas(cluster: LocalCluster, port: int, slot: int) -> int:
    """Replicas of ``slot`` in node ``port``'s CLUSTER SLOTS reply."""
    with contextlib.closing(cluster.node(port)) as r:
        for first, last, _master, *replicas in r.execute_command("CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return len(replicas)
    return 0


def _replica_of(cluster: LocalCluster, master: int) -> int:
    with contextlib.closing(cluster.node(master)) as r:
        return int(r.info("replication")["slave0"]["port"])


def _push_finals(cluster: LocalCluster, master: int, frozen: bool) -> None:
    """Requests on ``master`` end; with ``frozen`` its replica is stopped meanwhile."""
    replica = _replica_of(cluster, master)
    fleet = Fleet(cluster, 3, master)
    _push(fleet.pusher, fleet.step(0), NEVER)
    finals = [fleet.final(rid, 1) for rid in fleet.entries]
    _wait_replica_listed(cluster, fleet, finals)
    if frozen:
        cluster.procs[replica].send_signal(signal.SIGSTOP)
    try:
        assert set(_push(fleet.pusher, finals, NEVER)) == {"ok"}
    finally:
        cluster.procs[replica].send_signal(signal.SIGCONT)
    for rid, (stream, entry_id) in fleet.entries.items():
        pending = fleet.r.xpending_range(stream, fleet.keys.group, entry_id, entry_id, 1)
        assert bool(pending) == frozen, rid
        assert fleet.log(rid)[-1].finish_reason == "length"
        assert fleet.r.hget(fleet.keys.job(rid), "state") == b"done"


def _wait_calls(cluster: LocalCluster, port: int) -> int:
    with contextlib.closing(cluster.node(port)) as r:
        return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_an_entry_is_acknowledged_once_a_replica_has_its_end(
    redis_cluster: LocalCluster, cluster_client: Any
) -> None:
    """Replicas answering: terminal events written, entries XACKed. The replica frozen
    (SIGSTOP: WAIT gets no acknowledgement within its 200 ms): the events are written but
    the entries stay pending, for the reaper to settle."""
    master = redis_cluster.masters()[0]
    for frozen in (False, True):
        cluster_client.flushall(target_nodes=cluster_client.PRIMARIES)
        _push_finals(redis_cluster, master, frozen)
    redis_cluster.wait_healthy()


def test_a_slot_map_without_replicas_is_read_again_before_acknowledging(
    redis_cluster: LocalCluster, cluster_client: Any
) -> None:
    """A worker that read the slot map while the replicas were still unlisted (a fresh
    cluster) must not acknowledge ends unreplicated forever: it reads the map again, and
    its ends then wait for the replica (one WAIT on the master)."""
    master = redis_cluster.masters()[0]
    fleet = Fleet(redis_cluster, 3, master)
    _push(fleet.pusher, fleet.step(0), NEVER)
    finals = [fleet.final(rid, 1) for rid in fleet.entries]
    _wait_replica_listed(redis_cluster, fleet, finals)
    for nodes in fleet.r.nodes_manager.slots_cache.values():
        del nodes[1:]  # the map as a worker read it before the replicas were listed
    group = fleet.pusher._groups(finals)[0]
    assert fleet.pusher._known_replicas(group) == 0
    waits = _wait_calls(redis_cluster, master)
    assert set(_push(fleet.pusher, finals, NEVER)) == {"ok"}
    assert _wait_calls(redis_cluster, master) == waits + 1
    assert fleet.pusher._known_replicas(group) == 1
    for stream, entry_id in fleet.entries.values():  # the replica has them: acked
        assert not fleet.r.xpending_range(stream, fleet.keys.group, entry_id, entry_id, 1)


def test_a_dead_letter_takes_the_job_over(fleet: Fleet) -> None:
    rid = next(iter(fleet.entries))
    fleet.r.hset(fleet.keys.job(rid), "worker_id", "dead-worker")
    event = TokenEvent(request_id=rid, seq=0, finish_reason="error", error="poison",
                       error_kind="internal", usage=Usage())
    status = JobStatus(request_id=rid, state="failed", finish_reason="error", error="poison",
                       error_kind="internal", usage=Usage(), worker_id="w1")
    out = Outgoing(fleet.entries[rid], rid, 0, [], "", event=event, status=status)
    assert _push(fleet.pusher, [out], NEVER, ack=False) == ["lost"]
    assert _push(fleet.pusher, [out], NEVER, claim=True, ack=False) == ["ok"]
    assert fleet.log(rid)[-1].error == "poison"
    assert encode_event(fleet.log(rid)[-1]) == encode_outgoing(out)


def test_a_master_failing_over_parks_only_its_own_requests(redis_cluster: LocalCluster,
                                                           cluster_client: Any) -> None:
    fleet = Fleet(redis_cluster, 12)
    for seq in range(3):
        _push(fleet.pusher, fleet.step(seq), NEVER)
    victim = redis_cluster.master_of(fleet.keys.job("push-0"))
    on_victim = {rid for rid in fleet.entries
                 if redis_cluster.master_of(fleet.keys.job(rid)) == victim}
    redis_cluster.kill(victim)
    try:
        seq, settled_during = 3, set()
        for seq in range(3, 6):  # the outbox keeps stepping while the master is away
            settled_during |= {out.request_id for out, _ in
                               fleet.pusher.push(fleet.step(seq), NEVER, park=True)}
        assert settled_during == set(fleet.entries) - on_victim
        assert {out.request_id for out, _ in fleet.pusher.parked} == on_victim
        redis_cluster.wait_promoted(victim)
        deadline = time.monotonic() + 30
        while fleet.pusher.parked:
            assert time.monotonic() < deadline, "parked events never went out"
            fleet.pusher.push([], NEVER, park=True)
            time.sleep(0.05)
    finally:
        redis_cluster.restart(victim)
    for rid in fleet.entries:
        assert [e.seq for e in fleet.log(rid)] == list(range(6)), rid
