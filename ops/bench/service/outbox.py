"""Worker outbox bench: the fenced-push path at GPU step rates, against a real redis-server.

An "engine loop" thread hands the real ``Outbox`` one step of events per tick (``events``
per step, 256 by default: one per running sequence) at a fixed step rate, exactly as the
service's loop does (``outbox.put(list)``), for requests it really owns (entries claimed
in the consumer group, ``start_job`` run), so every event goes through the lease check,
the replay log and PUBLISH. Reported per row: steps/s kept, events/s sent, script calls
and events per call (coalescing: >``events`` means the outbox merged steps because Redis
was slower than the loop), ``put`` duration (must stay microseconds: the loop never
waits on Redis), emit -> sent latency, and the outbox's deepest queue. A last row times
one script call of one step alone, the ceiling of steps/s a single outbox can push.

    .venv/bin/python ops/bench/service/outbox.py
    .venv/bin/python ops/bench/service/outbox.py --rates 100,400 --seconds 2
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from ops.bench.service.event_publisher import CONSUMER, claim_all  # noqa: E402
from ops.bench.service.gateway_procs import start_redis  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402
from worker.service.jobs import Outgoing  # noqa: E402
from worker.service.outbox.thread import Outbox, queue_push  # noqa: E402
from worker.service.redis.connection import WorkerSettings, execute_scripts  # noqa: E402
from worker.service.redis.leases import SCRIPTS, HeldEntries  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Owned:
    """The requests the bench's worker owns, with each one's next seq."""

    def __init__(self, url: str, n: int) -> None:
        client = FerryClient.from_url(url)
        client.ensure_group()
        for i in range(n):
            client.enqueue(GenerateRequest(request_id=f"ob-{i}", prompt="x"))
        client.close()
        self.settings = WorkerSettings(redis_url=url, worker_id=CONSUMER)
        r = redis.Redis.from_url(url)
        self.entries = sorted(claim_all(r, self.settings, n).items())
        r.close()
        self.seq = 0

    def step(self) -> list[Outgoing]:
        now, seq = time.time(), self.seq
        self.seq += 1
        return [Outgoing(eid, rid, seq, [seq % 30000 + 1], f" tok{seq}", emitted_at=now)
                for rid, eid in self.entries]


def run_rate(owned: Owned, rate: float, seconds: float) -> dict[str, Any]:
    """The engine loop at ``rate`` steps/s for ``seconds``, feeding a fresh Outbox."""
    held = HeldEntries()
    for rid, eid in owned.entries:
        held.add(eid, rid)
    calls: list[tuple[int, float]] = []  # (events, sent_at)
    lat: list[float] = []
    refused: queue.Queue[Any] = queue.Queue()

    def observe(batch: list[Outgoing], sent_at: float) -> None:
        calls.append((len(batch), sent_at))
        lat.extend((sent_at - o.emitted_at) * 1000 for o in batch[::16])

    outbox = Outbox(owned.settings, held, refused, observe)
    outbox.start()
    puts, depth, steps = [], 0, 0
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        due = start + steps / rate
        if due > now:
            time.sleep(due - now)
        batch = owned.step()
        t0 = time.perf_counter()
        outbox.put(batch)
        puts.append((time.perf_counter() - t0) * 1e6)
        depth = max(depth, outbox.depth)
        steps += 1
    loop_s = time.perf_counter() - start
    outbox.flush(60)
    drained_s = time.perf_counter() - start
    outbox.close(5)
    events = steps * len(owned.entries)
    sizes = [n for n, _ in calls]
    return {
        "target_steps_s": rate, "steps_s": round(steps / loop_s, 1),
        "events_per_step": len(owned.entries), "events_s": round(events / drained_s),
        "script_calls": len(calls), "events_per_call": round(sum(sizes) / max(len(sizes), 1)),
        "put_us": {"p50": round(_pct(puts, 0.5), 1), "p99": round(_pct(puts, 0.99), 1),
                   "max": round(max(puts), 1)},
        "emit_to_sent_ms": {"p50": round(_pct(lat, 0.5), 2), "p99": round(_pct(lat, 0.99), 2)},
        "max_depth": depth, "drain_after_loop_s": round(drained_s - loop_s, 3),
        "refused": refused.qsize(),
    }


def script_call_ms(owned: Owned, n: int = 100) -> float:
    """One step's fenced push as one pipelined call, timed alone (median of ``n``)."""
    r = redis.Redis.from_url(owned.settings.redis_url)
    times = []
    for _ in range(n):
        batch = owned.step()
        t0 = time.perf_counter()
        execute_scripts(r, lambda pipe, b=batch: queue_push(pipe, owned.settings, b), SCRIPTS)
        times.append((time.perf_counter() - t0) * 1000)
    r.close()
    return round(_pct(times, 0.5), 3)


def table(result: dict[str, Any]) -> str:
    lines = [f"{'steps/s goal':>12} {'kept':>7} {'events/s':>9} {'calls':>6} {'ev/call':>7} "
             f"{'put p99 us':>10} {'put max us':>10} {'sent p50 ms':>11} {'p99 ms':>7} "
             f"{'max depth':>9}"]
    for r in result["rows"]:
        lines.append(
            f"{r['target_steps_s']:>12.0f} {r['steps_s']:>7.0f} {r['events_s']:>9} "
            f"{r['script_calls']:>6} {r['events_per_call']:>7} {r['put_us']['p99']:>10.1f} "
            f"{r['put_us']['max']:>10.1f} {r['emit_to_sent_ms']['p50']:>11.2f} "
            f"{r['emit_to_sent_ms']['p99']:>7.2f} {r['max_depth']:>9}")
    ms = result["one_step_script_call_ms"]
    lines.append(f"one step ({result['events_per_step']} events) as one script call: {ms} ms "
                 f"-> at most {1000 / ms:.0f} steps/s per outbox")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=256, help="events per step")
    ap.add_argument("--rates", default="100,200,400,1000", help="engine steps/s")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=str(
        ROOT / f"ops/bench/results/outbox-{socket.gethostname()}.json"))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ferry-outbox-"))
    proc, url = start_redis(tmp)
    try:
        owned = Owned(url, args.events)
        rows = [run_rate(owned, float(rate), args.seconds) for rate in args.rates.split(",")]
        result = {"host": socket.gethostname(), "events_per_step": args.events, "rows": rows,
                  "one_step_script_call_ms": script_call_ms(owned)}
    finally:
        proc.terminate()
        proc.wait()
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
