"""The output process on a Redis Cluster (3 masters, 3 replicas on loopback): its outbox
pushes per master (``cluster_push.py``), and a worker streams exactly what an in-process
worker streams, over requests spread on every shard (greedy, stop strings, logprobs,
n = 2, ``stream=false``). Failovers under the output process are covered by
``test_cluster_faults.py``, which runs the default (the output process on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.cluster.keys import ClusterKeys
from tests.redis_cluster import LocalCluster
from tests.worker.service.output_proc.test_service_output_process import (
    OUT,
    _requests,
    _serve,
    _stop_strings,
)

KEYS = ClusterKeys("ferry", 3)


def test_output_process_on_a_cluster_streams_what_in_process_streams(
        redis_cluster: LocalCluster, checkpoint: str, log_dir: Path, reference: Any) -> None:
    stops = _stop_strings(reference)
    url = redis_cluster.url
    requests = _requests(stops)
    assert {KEYS.shard_of(r.request_id) for r in requests} == {0, 1, 2}
    inproc = _serve(checkpoint, url, "cl-in-proc", log_dir, {"FERRY_OUTPUT_PROCESS": "0"},
                    requests, cluster=True)
    again = _requests(stops)
    outproc = _serve(checkpoint, url, "cl-out-proc", log_dir, OUT, again, cluster=True)
    stopped = 0
    for i, (a, b) in enumerate(zip(inproc, outproc, strict=True)):
        assert a == b, i
        stopped += a[-1]["finish_reason"] == "stop"
    assert stopped >= 4  # the stop strings did end requests early
    r = redis_cluster.client()
    try:
        for request in again:
            assert r.hget(KEYS.job(request.request_id), "state") == b"done"
    finally:
        r.close()
