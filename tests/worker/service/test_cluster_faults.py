"""Faults on a Redis Cluster (3 masters, 3 replicas, loopback): a worker killed with SIGKILL,
and a *master* killed with SIGKILL mid-generation under ``ferry gateway --redis-cluster``
and two ``ferry worker --redis-cluster`` serving seeded streams to the official ``openai``
client. The bar is the single-Redis one: every accepted request finishes, the client sees
contiguous ``seq`` with no duplicate, and seeded outputs equal an undisturbed run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from protocol.cluster.keys import ClusterKeys
from protocol.codec import decode_event
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.ferry.gateway_proc import GatewayProcess
from tests.redis_cluster import LocalCluster
from tests.redis_server import free_port
from tests.worker.service.procs import (
    ShardMonitor,
    Streams,
    WorkerProcess,
    assert_contiguous,
    client_for,
    kill_and_time_resume,
    start_all,
    tokens_of,
)

KEYS = ClusterKeys("ferry", 3)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as c:
        yield c


@pytest.fixture
def fresh(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The module's cluster, emptied, and whole again after the test (a killed master
    rejoins as a replica of the node that took over)."""
    cluster.flushall()
    yield cluster
    for port in cluster.ports:
        if port not in cluster.live_ports:
            cluster.restart(port)


def _requests(n: int, max_tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(prompt=f"The quick brown fox {i}", params=SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=100 + i, ignore_eos=True))
        for i in range(n)]


def _check_logs(r: Any, expected: dict[str, list[int]]) -> None:
    for rid, tokens in expected.items():
        events = [decode_event(x) for x in r.lrange(KEYS.events(rid), 0, -1)]
        assert_contiguous(events)
        assert tokens_of(events) == tokens, rid


def _busy_worker(r: Any, requests: list[GenerateRequest], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for req in requests:
            rid = req.request_id
            if r.llen(KEYS.events(rid)) >= 3 and r.hget(KEYS.job(rid), "state") == b"running":
                return str(r.hget(KEYS.job(rid), "worker_id"), "utf-8")
        time.sleep(0.02)
    raise AssertionError("no request got going")


def test_kill9_of_a_worker_is_resumed_by_the_other(fresh: LocalCluster, checkpoint: str,
                                                    log_dir: Path, reference: Any) -> None:
    requests = _requests(12, 160)
    outs = reference.llm.generate([q.prompt for q in requests], [q.params for q in requests])
    expected = {q.request_id: o.token_ids for q, o in zip(requests, outs, strict=True)}
    # A 20 s lease against a 1.5 s heartbeat TTL: resuming the victim's requests within
    # 10 s is the dead-worker takeover (heartbeat liveness) on a cluster, not the lease.
    workers = {w: WorkerProcess(checkpoint, fresh.url, w, log_dir, "--lease-s", "20",
                                "--heartbeat-ttl-s", "1.5", cluster=True)
               for w in ("ck1", "ck2")}
    r = client_for(fresh.url, cluster=True)
    try:
        start_all(*workers.values())
        monitor = ShardMonitor(fresh.url, [q.request_id for q in requests])
        monitor.start()
        streams = Streams(fresh.url, requests, cluster=True).start()
        victim = _busy_worker(r, requests)
        held = {q.request_id: r.llen(KEYS.events(q.request_id)) for q in requests
                if r.hget(KEYS.job(q.request_id), "worker_id") == victim.encode()
                and r.hget(KEYS.job(q.request_id), "state") == b"running"}
        resumed_after = kill_and_time_resume(r, workers[victim], held, KEYS.events)
        results = streams.join()
        monitor.stop()
    finally:
        for w in workers.values():
            w.kill()
    assert resumed_after < 10, "the victim's requests waited for the 20 s lease"
    for q in requests:
        assert_contiguous(results[q.request_id])
        assert tokens_of(results[q.request_id]) == expected[q.request_id]
    assert monitor.duplicates() == {}  # nothing was ever *published* twice
    _check_logs(r, expected)
    # An entry whose terminal event no replica confirmed in time (WAIT: a loaded machine)
    # is acknowledged by the reaper (cluster_push._ack_finals) once idle past the 20 s
    # lease, counted from its last delivery, which can take two reaper passes (5 s apart)
    # more: nothing may stay pending after that.
    deadline = time.monotonic() + 20 + 2 * 5 + 15
    while (pending := sum(int(r.xpending(s, KEYS.group)["pending"])
                          for s in KEYS.request_streams)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pending == 0, [(s, row) for s in KEYS.request_streams
                          for row in r.xpending_range(s, KEYS.group, "-", "+", 10)]
    r.close()


def _stream(client: openai.OpenAI, model: str, i: int, max_tokens: int, out: dict[int, Any],
            arrivals: dict[int, list[float]]) -> None:
    try:
        stream = client.completions.create(
            model=model, prompt=f"The quick brown fox {i}", max_tokens=max_tokens,
            temperature=1.0, seed=100 + i, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                arrivals[i].append(time.monotonic())
        out[i] = (text, finish)
    except Exception as exc:  # reported by the main thread
        out[i] = exc


def _busiest_master(cluster: LocalCluster) -> int:
    """The master holding the most replay logs (requests in flight)."""
    counts = {}
    for port in cluster.masters():
        with contextlib.closing(cluster.node(port)) as r:
            counts[port] = sum(1 for _ in r.scan_iter(match="ferry:events:*", count=1000))
    return max(counts, key=lambda p: counts[p])


def test_master_killed_mid_generation_loses_nothing(fresh: LocalCluster, checkpoint: str,
                                                    log_dir: Path, reference: Any) -> None:
    """The issue's "done when": ``ferry gateway --redis-cluster`` and two ``ferry worker
    --redis-cluster`` serve seeded streams through the openai client; SIGKILL of the master
    holding the most of them, mid-generation; every stream ends with the undisturbed text.
    During streaming the masters list the token channels (PUBSUB SHARDCHANNELS) and the
    requests' keys are spread over the masters."""
    n, max_tokens, port = 9, 240, free_port()
    workers = [WorkerProcess(checkpoint, fresh.url, w, log_dir, "--lease-s", "5", cluster=True)
               for w in ("cm1", "cm2")]
    results: dict[int, Any] = {}
    arrivals: dict[int, list[float]] = {i: [] for i in range(n)}
    with GatewayProcess(fresh.url, port, "--redis-cluster") as gateway:
        try:
            start_all(*workers)
            gateway.wait_healthy()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   max_retries=0, timeout=300)
            model = client.models.list().data[0].id
            threads = [threading.Thread(target=_stream, args=(client, model, i, max_tokens,
                                                              results, arrivals))
                       for i in range(n)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 120
            while min(len(a) for a in arrivals.values()) < 5:
                assert time.monotonic() < deadline, {i: len(a) for i, a in arrivals.items()}
                time.sleep(0.02)
            channels, spread = _sharding_seen(fresh)
            victim = _busiest_master(fresh)
            killed_at = time.monotonic()
            fresh.kill(victim)
            promoted_s = fresh.wait_promoted(victim)
            for t in threads:
                t.join(300)
            assert not any(t.is_alive() for t in threads), "streams never ended"
        finally:
            for w in workers:
                w.kill()
    outs = reference.llm.generate(
        [f"The quick brown fox {i}" for i in range(n)],
        [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=100 + i, ignore_eos=True)
         for i in range(n)])
    for i in range(n):
        assert not isinstance(results[i], Exception), results[i]
        assert results[i] == (outs[i].text, "length"), i
    assert len(channels) >= n and all(c.startswith(b"ferry:tokens:{") for c in channels)
    assert sum(1 for count in spread.values() if count) >= 2, spread
    resumed = max(next((t for t in a if t > killed_at), killed_at) for a in arrivals.values())
    print(f"\nfailover: promoted after {promoted_s:.2f} s, every stream flowing again "
          f"{resumed - killed_at:.2f} s after the kill")


def _sharding_seen(cluster: LocalCluster) -> tuple[set[bytes], dict[int, int]]:
    """Token channels the masters list (PUBSUB SHARDCHANNELS), and job hashes per master."""
    channels: set[bytes] = set()
    spread = {}
    for port in cluster.masters():
        with contextlib.closing(cluster.node(port)) as r:
            channels |= set(r.execute_command("PUBSUB", "SHARDCHANNELS", "ferry:tokens:*"))
            spread[port] = sum(1 for _ in r.scan_iter(match="ferry:job:*", count=1000))
    return channels, spread
