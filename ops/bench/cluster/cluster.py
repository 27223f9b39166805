"""Token path on Redis Cluster: events/s and Redis CPU-seconds per event, one Redis vs. a
cluster of 1 and 3 masters, side by side in one run.

Each row runs the same workload: ``--publishers`` processes, each one a worker's outbox
holding ``--requests`` requests it really owns (entries claimed in the consumer group,
``start_job`` run), sending one event per request per step as fast as it can, through the
outbox's own code (one ``FENCED_PUSH`` call per step on one Redis; ``ClusterPusher`` on a
cluster: per master one pipeline of one script call per request); and one subscriber
process, the gateway's hub (``AsyncFerryClient``) following every token channel. Every
cluster master has one replica, so its CPU includes feeding the replication stream.

Reported per row: events/s sent and received, and each master's CPU (``used_cpu_user +
used_cpu_sys`` from ``INFO CPU`` before and after) per event it handled. A master is one
core (Redis runs commands on one thread), so 1 / (CPU-seconds per event) is the events/s
one shard carries at 100% of its core: the per-shard ceiling, whatever this 2-core
machine can offer it. Two cores cannot show the scaling itself (the publishers, the
subscriber and the masters share them); the per-event cost per shard can.

    .venv/bin/python ops/bench/cluster/cluster.py
    .venv/bin/python ops/bench/cluster/cluster.py --seconds 5 --requests 128 --publishers 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.cluster.cluster_load import publish, subscribe  # noqa: E402
from ops.bench.cluster.cluster_nodes import Nodes, start_cluster, start_single  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.cluster.nodes import Replication  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402


def _cpu(nodes: Nodes) -> dict[int, float]:
    return {port: nodes.cpu_s(port) for port in nodes.masters}


def run_row(name: str, nodes: Nodes, args: argparse.Namespace, requests: int
            ) -> dict[str, Any]:
    """One configuration: subscriber up, publishers for ``args.seconds``, CPU deltas."""
    ctx = mp.get_context("spawn")
    total = args.publishers * requests
    ready, done = ctx.Event(), ctx.Event()
    received = ctx.Value("q", 0)
    slug = "".join(c if c.isalnum() else "_" for c in name)  # ids are key-safe
    rids = [[f"{slug}-p{p}-r{i}" for i in range(requests)] for p in range(args.publishers)]
    sub = ctx.Process(target=subscribe, args=(nodes.url, nodes.cluster, sum(rids, []),
                                              ready, done, received))
    sub.start()
    if not ready.wait(60):
        raise RuntimeError("the subscriber did not subscribe every channel")
    results = ctx.Queue()
    pubs = [ctx.Process(target=publish, args=(nodes.url, nodes.cluster, ids, args.seconds,
                                              results)) for ids in rids]
    before = _cpu(nodes)
    for p in pubs:
        p.start()
    sent = [results.get(timeout=args.seconds + 120) for _ in pubs]
    for p in pubs:
        p.join(30)
    time.sleep(0.5)  # let the subscriber take the tail
    after = _cpu(nodes)
    done.set()
    sub.join(30)
    events = sum(s["events"] for s in sent)
    wall = max(s["seconds"] for s in sent)
    per_master = {port: after[port] - before[port] for port in nodes.masters}
    per_event_us = {port: cpu / events * len(nodes.masters) * 1e6
                    for port, cpu in per_master.items()}
    mean_us = sum(per_event_us.values()) / len(per_event_us)
    return {
        "config": name, "masters": len(nodes.masters), "requests": total,
        "events_per_call": round(requests / len(nodes.masters)),
        "events_sent": events, "events_s": round(events / wall),
        "events_received": int(received.value),
        "master_cpu_s": {str(p): round(c, 3) for p, c in per_master.items()},
        "cpu_us_per_event_per_master": round(mean_us, 2),
        "shard_ceiling_events_s": round(1e6 / mean_us),
        "refused": sum(s["refused"] for s in sent),
    }


def enqueue_ms(nodes: Nodes, n: int = 300) -> dict[str, dict[str, float]]:
    """What WAIT costs an enqueue: p50/p99 ms of the protocol client's cluster enqueue
    (reserve, XADD, record) with and without waiting for one replica."""
    out = {}
    for replicas in (0, 1):
        client = FerryClient.from_url(nodes.url, prefix=f"wait{replicas}", cluster=True,
                                      replication=Replication(replicas=replicas))
        client.ensure_group()
        times = []
        for i in range(n):
            start = time.perf_counter()
            client.enqueue(GenerateRequest(request_id=f"w{replicas}-{i}", prompt="x"))
            times.append((time.perf_counter() - start) * 1000)
        client.close()
        times.sort()
        out[f"wait_replicas_{replicas}"] = {"p50": round(times[n // 2], 2),
                                            "p99": round(times[int(n * 0.99)], 2)}
    return out


def call_and_event_cost(full: dict[str, Any], third: dict[str, Any]) -> dict[str, float]:
    """A master's CPU per event is c(n) = per_event + per_call / n for calls of n events:
    solved from the 1-master rows at two call sizes. A fleet of W workers with batches of
    B over M masters sends each master calls of about B / M events."""
    n1, c1 = full["events_per_call"], full["cpu_us_per_event_per_master"]
    n2, c2 = third["events_per_call"], third["cpu_us_per_event_per_master"]
    per_call = (c2 - c1) / (1 / n2 - 1 / n1)
    return {"per_event_us": round(c1 - per_call / n1, 2), "per_call_us": round(per_call, 1)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'config':<22} {'masters':>7} {'ev/call':>7} {'events/s':>9} {'received':>9} "
             f"{'CPU us/event/master':>19} {'ceiling ev/s/shard':>18} {'refused':>7}"]
    for r in rows:
        lines.append(f"{r['config']:<22} {r['masters']:>7} {r['events_per_call']:>7} "
                     f"{r['events_s']:>9} "
                     f"{r['events_received']:>9} {r['cpu_us_per_event_per_master']:>19.2f} "
                     f"{r['shard_ceiling_events_s']:>18} {r['refused']:>7}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--publishers", type=int, default=2, help="worker outboxes")
    ap.add_argument("--requests", type=int, default=128, help="requests per publisher")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", default=str(
        ROOT / f"ops/bench/results/cluster-{socket.gethostname()}.json"))
    args = ap.parse_args()
    rows = []
    third = max(1, args.requests // 3)
    for name, start, requests in (
            ("one redis", lambda d: start_single(d), args.requests),
            ("cluster, 1 master", lambda d: start_cluster(d, masters=1), args.requests),
            ("cluster, 1 master, 1/3", lambda d: start_cluster(d, masters=1), third),
            ("cluster, 3 masters", lambda d: start_cluster(d, masters=3), args.requests)):
        with start(Path(tempfile.mkdtemp(prefix="ferry-cluster-bench-"))) as nodes:
            rows.append(run_row(name, nodes, args, requests))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if nodes.cluster and len(nodes.masters) == 3:
                enqueue = enqueue_ms(nodes)
    result = {"host": socket.gethostname(), "publishers": args.publishers,
              "requests_per_publisher": args.requests, "seconds": args.seconds, "rows": rows,
              "per_master_cost": call_and_event_cost(rows[1], rows[2]),
              "enqueue_ms_3_masters": enqueue}
    print(table(rows))
    cost = result["per_master_cost"]
    print(f"a master's CPU per event = {cost['per_event_us']} us + {cost['per_call_us']} us "
          "/ (events per call)")
    print(f"enqueue on 3 masters, ms: {enqueue}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
