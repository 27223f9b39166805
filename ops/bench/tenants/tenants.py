"""Tenants bench: the issue's two fairness measurements, on a real redis-server and a real
``ferry worker`` (the embedded default model on the CPU).

* ``late``: one worker of 4 sequences; tenant a queues 40 requests, tenant b sends 4 two
  seconds later (or once 8 of a's are done, on a fast machine). Reported: how many of a's
  had finished when b's last one did (first come, first served: all 40).
* ``weights``: tenants h (weight 3) and l (weight 1) queue 300 and 100 equal requests
  before the worker starts; reported: each one's share of the first 200 started.

    .venv/bin/python ops/bench/tenants/tenants.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from ops.bench.service.gateway_procs import start_redis  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from protocol.tenants.ids import scoped_id  # noqa: E402
from worker.models import default_model_path  # noqa: E402

KEYS = Keys()


def _requests(tenant: str, n: int, max_tokens: int) -> list[GenerateRequest]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [GenerateRequest(request_id=scoped_id(tenant, f"r{i}"), tenant=tenant,
                            prompt=f"tenant {tenant} asks question number {i}", params=params)
            for i in range(n)]


def _field(r: redis.Redis, q: GenerateRequest, name: str) -> float:
    value = r.hget(KEYS.job(q.request_id), name)
    return float(value) if value else float("inf")


def _worker(url: str, tmp: Path, seqs: int) -> subprocess.Popen[bytes]:
    log = open(tmp / f"worker-{time.monotonic_ns()}.log", "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", "worker", "--model",
                             default_model_path(), "--redis-url", url, "--worker-id", "bench",
                             "--max-num-seqs", str(seqs)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    r = redis.Redis.from_url(url)
    while not r.exists(KEYS.worker("bench")):
        if proc.poll() is not None:
            raise RuntimeError("the worker exited")
        time.sleep(0.1)
    return proc


def _wait_done(r: redis.Redis, requests: list[GenerateRequest]) -> None:
    while any(r.hget(KEYS.job(q.request_id), "state") != b"done" for q in requests):
        time.sleep(0.2)


def late(url: str, tmp: Path) -> dict[str, Any]:
    r, client = redis.Redis.from_url(url), FerryClient.from_url(url)
    r.flushall()
    flood, small = _requests("a", 40, 128), _requests("b", 4, 128)
    proc = _worker(url, tmp, 4)
    try:
        sent = time.monotonic()
        for q in flood:
            client.enqueue(q)
        while time.monotonic() - sent < 2 and sum(
                _field(r, q, "finished_at") < float("inf") for q in flood) < 8:
            time.sleep(0.05)
        done_before = sum(_field(r, q, "finished_at") < float("inf") for q in flood)
        for q in small:
            client.enqueue(q)
        _wait_done(r, flood + small)
    finally:
        proc.kill()
        proc.wait(10)
    b_last = max(_field(r, q, "finished_at") for q in small)
    return {"a_done_when_b_sent": done_before,
            "a_done_when_b_finished": sum(_field(r, q, "finished_at") < b_last for q in flood),
            "fcfs_would_be": 40}


def weights(url: str, tmp: Path) -> dict[str, Any]:
    r, client = redis.Redis.from_url(url), FerryClient.from_url(url)
    r.flushall()
    heavy, light = _requests("h", 300, 8), _requests("l", 100, 8)
    for q in heavy:
        client.enqueue(q, weight=3)
    for q in light:
        client.enqueue(q, weight=1)
    proc = _worker(url, tmp, 8)
    try:
        _wait_done(r, heavy[:150] + light[:50])
    finally:
        proc.kill()
        proc.wait(10)
    starts = sorted([(_field(r, q, "started_at"), "h") for q in heavy]
                    + [(_field(r, q, "started_at"), "l") for q in light])[:200]
    h = sum(who == "h" for _t, who in starts)
    return {"first": 200, "heavy_w3": h, "light_w1": 200 - h,
            "ratio": round(h / max(1, 200 - h), 3), "target": 3.0}


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        proc, url = start_redis(tmp)
        try:
            out = {"late": late(url, tmp), "weights": weights(url, tmp)}
        finally:
            proc.kill()
            proc.wait(10)
    print(json.dumps(out, indent=2))
    (ROOT / "ops/bench/results/tenants.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
