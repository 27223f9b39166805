"""A master killed with SIGKILL under streaming: time to promotion, time until the streams it
held flow again, and what the others felt, for a few ``cluster-node-timeout`` values.

The token path only, with the real parts: a publisher process is a worker's outbox
(``ClusterPusher``, parking what the dead master cannot take) sending one event per
request per step at ``--steps`` steps/s; a subscriber process is a gateway's hub
(``AsyncFerryClient``: sharded pub/sub, gap filling from the replay logs, dedup by
``seq``) following every request. After a warm-up the master holding the most requests is
killed. Reported per row: seconds to promotion (the replica serves the slots in every
node's view), seconds from the kill until the streams of the dead master flowed again
(the end of their longest pause; p50 and max), the longest pause any other stream saw,
events the publisher wrote again into logs the failover had cut short, and whether every
stream arrived contiguous and duplicate-free. (The end-to-end run with the model,
``ferry gateway`` and two workers is ``tests/worker/service/test_cluster_faults.py``.)

    .venv/bin/python ops/bench/cluster/cluster_failover.py
    .venv/bin/python ops/bench/cluster/cluster_failover.py --node-timeouts 1000,5000,15000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ferry.local_cluster import wait_promoted  # noqa: E402
from ops.bench.cluster.cluster_load import claim  # noqa: E402
from ops.bench.cluster.cluster_nodes import start_cluster  # noqa: E402
from protocol.aclient import AsyncFerryClient  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from worker.service.jobs import Outgoing  # noqa: E402
from worker.service.outbox.cluster_push import ClusterPusher  # noqa: E402
from worker.service.outbox.thread import encode_outgoing  # noqa: E402
from worker.service.redis.connection import WorkerSettings  # noqa: E402

PREFIX = "b0"


def publish(url: str, rids: list[str], steps: int, rate: float, ready: Any, out: Any) -> None:
    """A worker's outbox: ``steps`` steps at ``rate``, then every request's terminal event."""
    settings = WorkerSettings(redis_url=url, worker_id="bench-outbox", prefix=PREFIX,
                              redis_cluster=True)
    client = FerryClient.from_url(url, prefix=PREFIX, cluster=True)
    held = claim(client, settings, rids)
    pusher = ClusterPusher(settings, client.redis, encode_outgoing, lambda _rid: True)
    ready.set()
    never, start = threading.Event(), time.monotonic()
    for step in range(steps + 1):
        time.sleep(max(0.0, start + step / rate - time.monotonic()))
        final = step == steps
        batch = [_final(entry, rid, step) if final else
                 Outgoing(entry, rid, step, [step + 1], f" {step}") for rid, entry in held]
        pusher.push(batch, never, park=True)
    while pusher.parked:
        time.sleep(0.05)
        pusher.push([], never, park=True)
    out.put({"repaired": pusher.sent.repaired})


def _final(entry: tuple[str, str], rid: str, seq: int) -> Outgoing:
    from protocol.models import JobStatus, TokenEvent, Usage

    usage = Usage(prompt_tokens=1, completion_tokens=seq, total_tokens=seq + 1)
    event = TokenEvent(request_id=rid, seq=seq, finish_reason="length", usage=usage)
    status = JobStatus(request_id=rid, state="done", finish_reason="length", usage=usage,
                       worker_id="bench-outbox")
    return Outgoing(entry, rid, seq, [], "", event=event, status=status)


def follow(url: str, rids: list[str], ready: Any, out: Any) -> None:
    """A gateway's hub following every request to its end: (seq, arrival time) each."""

    async def one(client: AsyncFerryClient, rid: str, got: dict[str, list[Any]]) -> None:
        async with client.subscribe(rid) as sub:
            ready.release()
            async for event in sub.events(timeout=600):
                got[rid].append((event.seq, time.time()))

    async def run() -> dict[str, list[Any]]:
        client = AsyncFerryClient.from_url(url, prefix=PREFIX, cluster=True,
                                           poll_interval_s=0.25)
        got: dict[str, list[Any]] = {rid: [] for rid in rids}
        await asyncio.gather(*(one(client, rid, got) for rid in rids))
        await client.aclose()
        return got

    out.put(asyncio.run(run()))


def run_row(node_timeout_ms: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    rids = [f"fo{node_timeout_ms}-r{i}" for i in range(args.requests)]
    with start_cluster(Path(tempfile.mkdtemp(prefix="ferry-failover-")), 3,
                       node_timeout_ms) as nodes:
        subscribed, published, got, done = ctx.Semaphore(0), ctx.Event(), ctx.Queue(), ctx.Queue()
        sub = ctx.Process(target=follow, args=(nodes.url, rids, subscribed, got))
        sub.start()
        for _ in rids:
            subscribed.acquire(timeout=60)
        steps = int(args.rate * (args.warmup + args.after))
        pub = ctx.Process(target=publish, args=(nodes.url, rids, steps, args.rate, published,
                                                done))
        pub.start()
        published.wait(60)
        time.sleep(args.warmup)
        owners = _masters_of(nodes.url, rids)
        victim = max(set(owners.values()), key=list(owners.values()).count)
        on_victim = {rid for rid, port in owners.items() if port == victim}
        killed_at = time.time()
        os.kill(nodes.procs[victim].pid, signal.SIGKILL)
        live = [p for p in nodes.procs if p != victim]
        promoted_s = wait_promoted(live, victim)
        repaired = done.get(timeout=args.after + 120)["repaired"]
        arrivals = got.get(timeout=120)
        pub.join(10)
        sub.join(10)
    return _summary(node_timeout_ms, promoted_s, killed_at, arrivals, on_victim, repaired,
                    steps)


def _masters_of(url: str, rids: list[str]) -> dict[str, int]:
    """Request id -> port of the master holding its keys."""
    client = FerryClient.from_url(url, prefix=PREFIX, cluster=True)
    owners = {rid: int(client.redis.get_node_from_key(client.keys.job(rid)).port)
              for rid in rids}
    client.close()
    return owners


def _gaps(arrivals: list[Any]) -> list[tuple[float, float]]:
    """(pause, arrival that ended it) between consecutive events of one stream."""
    return [(b - a, b) for (_, a), (_, b) in zip(arrivals, arrivals[1:], strict=False)]


def _longest_pause(arrivals: list[Any]) -> float:
    return max((gap for gap, _ in _gaps(arrivals)), default=0.0)


def _end_of_longest_pause(arrivals: list[Any]) -> float:
    """When a stream flowed again after its longest pause (the failover's)."""
    return max(_gaps(arrivals))[1]


def _summary(node_timeout_ms: int, promoted_s: float, killed_at: float,
             arrivals: dict[str, list[Any]], on_victim: set[str], repaired: int,
             steps: int) -> dict[str, Any]:
    resumed = [_end_of_longest_pause(arrivals[rid]) - killed_at for rid in on_victim]
    others = [rid for rid in arrivals if rid not in on_victim]
    pause = max((_longest_pause(arrivals[rid]) for rid in others), default=0.0)
    contiguous = all([s for s, _ in arrivals[rid]] == list(range(steps + 1))
                     for rid in arrivals)
    return {"node_timeout_ms": node_timeout_ms, "promoted_s": round(promoted_s, 2),
            "streams_on_dead_master": len(on_victim),
            "resumed_s_p50": round(statistics.median(resumed), 2),
            "resumed_s_max": round(max(resumed), 2),
            "other_streams_longest_pause_s": round(pause, 2),
            "events_repaired": repaired, "contiguous_no_duplicates": contiguous}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'node timeout':>12} {'promoted':>9} {'streams':>7} {'resumed p50':>11} "
             f"{'max':>6} {'others paused':>13} {'repaired':>8} {'contiguous':>10}"]
    for r in rows:
        lines.append(f"{r['node_timeout_ms']:>10}ms {r['promoted_s']:>8.2f}s "
                     f"{r['streams_on_dead_master']:>7} {r['resumed_s_p50']:>10.2f}s "
                     f"{r['resumed_s_max']:>5.2f}s {r['other_streams_longest_pause_s']:>12.2f}s "
                     f"{r['events_repaired']:>8} {str(r['contiguous_no_duplicates']):>10}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--node-timeouts", default="1000,5000", help="cluster-node-timeout, ms")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=40.0, help="steps/s (an event per request)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--after", type=float, default=25.0, help="seconds streamed after the kill")
    ap.add_argument("--out", default=str(
        ROOT / f"ops/bench/results/cluster-failover-{socket.gethostname()}.json"))
    args = ap.parse_args()
    rows = []
    for timeout in (int(t) for t in args.node_timeouts.split(",")):
        rows.append(run_row(timeout, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    result = {"host": socket.gethostname(), "requests": args.requests, "steps_s": args.rate,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
