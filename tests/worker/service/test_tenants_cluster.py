"""The late small tenant on a Redis Cluster (3 masters, 3 replicas on loopback), one real
``ferry worker --redis-cluster``: each shard keeps its own counters (the backlog keys carry
the shard's hash tag), requests spread over the shards by id hash, and the worker pulls
every shard, so the fair share still holds over the whole queue. b arrives once 8 of a's
have started (read from ``started_at``, which the pull writes: the ``done`` states reach
Redis through the outbox a wave late, and a fast engine had 16 started by then).
"""

from __future__ import annotations

import time
from pathlib import Path

from protocol.client import FerryClient
from protocol.cluster.keys import ClusterKeys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tenants import fair
from protocol.tenants.ids import scoped_id
from tests.redis_cluster import LocalCluster
from tests.worker.service.procs import WorkerProcess, start_all
from worker.models import default_model_path

KEYS = ClusterKeys("ferry", 3)
PARAMS = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


def _requests(tenant: str, n: int) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=scoped_id(tenant, f"r{i}"), tenant=tenant,
                            prompt=f"tenant {tenant} asks question number {i}", params=PARAMS)
            for i in range(n)]


def test_late_small_tenant_on_a_cluster(redis_cluster: LocalCluster, log_dir: Path) -> None:
    client = FerryClient.from_url(redis_cluster.url, cluster=True)
    rc = client.redis

    def times(q: GenerateRequest) -> tuple[str, float]:
        state, finished = rc.hmget(KEYS.job(q.request_id), "state", "finished_at")
        return (state or b"").decode(), float(finished or "inf")

    def started() -> int:  # as the pull writes it: ``done`` reaches Redis a wave late
        return sum(rc.hget(KEYS.job(q.request_id), "started_at") is not None for q in flood)

    flood, late = _requests("a", 40), _requests("b", 4)
    worker = WorkerProcess(default_model_path(), redis_cluster.url, "cw1", log_dir,
                           "--max-num-seqs", "4", cluster=True)
    try:
        start_all(worker)
        client.ensure_group()
        for request in flood:
            client.enqueue(request)
        shards = {KEYS.shard_of(q.request_id) for q in flood}
        sent = time.monotonic()
        while time.monotonic() - sent < 2.0 and started() < 8:
            time.sleep(0.05)
        for request in late:
            client.enqueue(request)
        started_before = started()  # an upper bound: counted after b's were queued
        deadline = time.monotonic() + 300
        while not all(times(q)[0] == "done" for q in flood + late):
            assert time.monotonic() < deadline, "not every request finished"
            time.sleep(0.2)
        waiting = sum(rc.xlen(fair.bell(s)) for s in KEYS.request_streams)
        a_finish = sorted(times(q)[1] for q in flood)
        b_last = max(times(q)[1] for q in late)
    finally:
        worker.kill()
        client.close()
    assert len(shards) == 3  # the flood's ids spread over every shard
    assert started_before <= 12 and waiting == 0, started_before
    print(f"late tenant on a cluster: b's last finished after "
          f"{sum(t < b_last for t in a_finish)} of a's ({started_before} started when b came)")
    assert b_last < a_finish[19], sum(t < b_last for t in a_finish)
