"""Prefix affinity on a Redis Cluster: the board lives in the fleet's slot with the
heartbeats, the producer's look-up and the cluster enqueue carry the mark, and a lane
shard's fair pull honours it (the script's clock included)."""

from __future__ import annotations

import time
from typing import Any

from protocol.affinity.board import queue_advertise
from protocol.affinity.chunks import prefix_chunks
from protocol.affinity.router import AffinitySettings
from protocol.client import FerryClient
from protocol.cluster.keys import ClusterKeys
from protocol.codec import decode_entry
from protocol.models import GenerateRequest, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from protocol.tenants import fair

KEYS = ClusterKeys("ferry", 3)


def test_a_marked_request_on_a_cluster_goes_to_the_holder_first(
        redis_cluster: Any, cluster_client: Any) -> None:
    r = cluster_client
    ensure_group(r, KEYS)
    assert KEYS.affinity("w").split(":")[2] == KEYS.worker("w").split(":")[2]  # one slot
    pipe = r.pipeline()
    write_heartbeat(pipe, KEYS, WorkerHeartbeat(worker_id="w-hold", model="m", started_at=1.0,
                                                updated_at=time.time()), Ttls())
    pipe.execute()
    convo = GenerateRequest(prompt="cluster context " * 60, request_id="t::c1", tenant="t")
    pipe = r.pipeline()
    queue_advertise(pipe, KEYS.affinity("w-hold"), dict.fromkeys(prefix_chunks(convo), 1.0),
                    [], 4000)
    pipe.execute()
    client = FerryClient.from_url(redis_cluster.url, cluster=True, shards=3,
                                  affinity=AffinitySettings(steal_ms=60_000))
    try:
        client.enqueue(convo)
        assert client.router.marked == 1
    finally:
        client.close()
    stream = KEYS.stream_for(convo.request_id, convo.priority)
    node = r.get_node_from_key(stream)
    shard = r.get_redis_connection(node)
    assert fair.pull(shard, stream, KEYS.group, "w-else", 4)[0] == []
    [(_, fields)], _ = fair.pull(shard, stream, KEYS.group, "w-hold", 4)
    assert decode_entry(fields) == convo and fields[b"prefer"] == b"w-hold"
