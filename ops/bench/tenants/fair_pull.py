"""Fair backlog bench: what the tenants' fair share costs Redis, side by side with the old path.

Against one real redis-server, for the producer and the worker side of the queue:

* ``enqueue``: the version-3 enqueue script (job hash + XADD into the lane stream, kept
  here verbatim as the baseline) vs today's ``ENQUEUE_LUA`` (job hash + push onto the
  tenant's backlog with the VTC lift), one EVAL per request as the clients send them;
* ``take``: a plain ``XREADGROUP COUNT 4`` of the lane vs ``fair.pull(..., 4)`` (pick the
  lowest counter, move its head into the stream, XREADGROUP it, charge), with 1 tenant
  and with 100 tenants backlogged, until the queue is empty; each entry is XACKed.

Reported: microseconds per request (client round trips included, as a worker or gateway
pays them), and Redis' own CPU per request (``INFO commandstats``' ``usec`` of the
commands the bench sends: EVAL, XREADGROUP, XACK). Both sides run on this machine's
loopback, so the wall numbers hold the round trip; the Redis CPU column is the cost that
scales with the fleet.

    .venv/bin/python ops/bench/tenants/fair_pull.py
    .venv/bin/python ops/bench/tenants/fair_pull.py --requests 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from ops.bench.service.gateway_procs import start_redis  # noqa: E402
from protocol.codec import encode_request  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402
from protocol.store import Ttls, enqueue_script, ensure_group  # noqa: E402
from protocol.tenants import fair  # noqa: E402
from protocol.tenants.ids import scoped_id  # noqa: E402

KEYS = Keys()
OLD_ENQUEUE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('DEL', KEYS[3], KEYS[4])
local id = redis.call('XADD', KEYS[2], '*', 'data', ARGV[5])
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', 'queued', 'created_at', ARGV[2],
           'entry_id', id, 'stream', KEYS[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'model', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return id
"""


def _requests(n: int, tenants: int) -> list[GenerateRequest]:
    out = []
    for i in range(n):
        tenant = f"t{i % tenants}"
        out.append(GenerateRequest(request_id=scoped_id(tenant, f"r{i}"), tenant=tenant,
                                   prompt="def f(x):\n    return x\n" * 4))
    return out


TOP_LEVEL = ("cmdstat_eval", "cmdstat_xreadgroup", "cmdstat_xack")
"""The commands the bench sends itself: a script's ``usec`` already holds the commands it
runs (which ``commandstats`` lists again on their own lines), so only these are summed."""


def _redis_usec(r: redis.Redis) -> float:
    stats: Any = r.info("commandstats")
    return float(sum(stats[name]["usec"] for name in TOP_LEVEL if name in stats))


def _enqueue(r: redis.Redis, requests: list[GenerateRequest], fair_path: bool) -> float:
    ttls = Ttls()
    for request in requests:
        rid = request.request_id
        if fair_path:
            script, keys, argv = enqueue_script(KEYS, request, ttls, 1.0)
        else:
            script = OLD_ENQUEUE_LUA
            keys = [KEYS.job(rid), KEYS.requests, KEYS.events(rid), KEYS.cancelled(rid)]
            argv = [rid, repr(request.created_at), "", ttls.job_s, encode_request(request)]
        r.eval(script, len(keys), *keys, *argv)
    return len(requests)


def _take(r: redis.Redis, fair_path: bool) -> int:
    taken = 0
    while True:
        if fair_path:
            entries, _marks = fair.pull(r, KEYS.requests, KEYS.group, "bench", 4)
        else:
            reply: Any = r.xreadgroup(KEYS.group, "bench", {KEYS.requests: ">"}, count=4)
            entries = reply[0][1] if reply else []
        if not entries:
            return taken
        r.xack(KEYS.requests, KEYS.group, *[e[0] for e in entries])
        taken += len(entries)


def _measure(r: redis.Redis, what: str, fn: Any) -> dict[str, float]:
    r.config_resetstat()
    start = time.perf_counter()
    n = fn()
    wall = time.perf_counter() - start
    return {f"{what}_us": round(wall / n * 1e6, 1),
            f"{what}_redis_us": round(_redis_usec(r) / n, 1)}


def run_case(url: str, n: int, tenants: int, fair_path: bool) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    r.flushall()
    ensure_group(r, KEYS)
    requests = _requests(n, tenants)
    row: dict[str, Any] = {"path": "fair backlog" if fair_path else "plain stream (v3)",
                           "tenants": tenants, "requests": n}
    row.update(_measure(r, "enqueue", lambda: _enqueue(r, requests, fair_path)))
    row.update(_measure(r, "take", lambda: _take(r, fair_path)))
    r.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--out", default=str(ROOT / "ops/bench/results/fair_pull.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            rows = [run_case(url, args.requests, tenants, fair_path)
                    for tenants in (1, 100) for fair_path in (False, True)]
        finally:
            proc.kill()
            proc.wait(10)
    head = ("path", "tenants", "enqueue_us", "enqueue_redis_us", "take_us", "take_redis_us")
    print(" | ".join(f"{h:>18}" for h in head))
    for row in rows:
        print(" | ".join(f"{row[h]!s:>18}" for h in head))
    Path(args.out).write_text(json.dumps({"requests": args.requests, "rows": rows},
                                         indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
