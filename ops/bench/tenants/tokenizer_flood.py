"""Tokenizer flood bench: one tenant loops large ``/tokenize`` calls, another keeps using
the fleet; how long do the other tenant's ``/tokenize`` calls and generations take?

A real redis-server, a real ``ferry gateway`` (two API keys: tenants a and b) and a real
``ferry worker`` of the embedded default model on the CPU, all run from ``--src`` (so the
same script measures another source tree, e.g. ``git archive main``). Two phases of
``--seconds`` each, the same layout:

* ``quiet``: tenant b alone: one client calling ``/tokenize`` on a short text every 50 ms,
  one client asking for 16-token completions in a loop;
* ``flood``: the same, while tenant a's ``--flooders`` clients (threads of a process of
  their own, so they do not share b's GIL) loop ``/tokenize`` on ``--chars``-character
  texts, retrying at once on a 429, as a hostile client would;
* ``polite`` (with ``--polite``): the same flood, waiting each 429's ``Retry-After``.

CPU use per process (cores, over the phase) is recorded too: on a small machine the
flood's clients and the gateway's 429s compete with the worker for the same cores.

Printed: a table of b's p50 (and p90) latencies per phase, and what a's flood got
(answered, 429s); written to ``ops/bench/results/<--name>.json``.

    .venv/bin/python ops/bench/tenants/tokenizer_flood.py --name tokenizer_flood
    .venv/bin/python ops/bench/tenants/tokenizer_flood.py --src /tmp/base \
        --name tokenizer_flood-main
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from ops.bench.service.gateway_procs import _stop, _wait_port, free_port, start_redis  # noqa: E402
from worker.models import default_model_path  # noqa: E402

KEYS = {"a": "bench-key-a", "b": "bench-key-b"}
WORDS = ("ferry", "queue", "token", "worker", "redis", "stream", "gateway", "batch", "the")


def _text(chars: int, salt: int) -> str:
    words = [WORDS[(i * 7 + salt) % len(WORDS)] + str(i % 97) for i in range(chars // 4)]
    return " ".join(words)[:chars]


def _start(src: Path, url: str, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    env = dict(os.environ, PYTHONPATH=str(src), FERRY_DEVICE="cpu", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", FERRY_API_KEYS=",".join(KEYS.values()),
               FERRY_TOKENIZER_TIMEOUT_S="120", FERRY_MAX_QUEUE_LAG="none")
    worker = subprocess.Popen(
        [sys.executable, "-m", "ferry.cli", "worker", "--model", str(default_model_path()),
         "--redis-url", url, "--worker-id", "bench"], cwd=src, env=env,
        stdout=open(tmp / "worker.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "ferry.cli", "gateway", "--redis-url", url, "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning"], cwd=src, env=env,
        stdout=open(tmp / "gateway.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    _wait_port(port, gateway, "ferry gateway")
    r = redis.Redis.from_url(url)
    while not any(r.scan_iter("ferry:worker:*")):
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited: see {tmp / 'worker.log'}")
        time.sleep(0.2)
    return [gateway, worker], f"http://127.0.0.1:{port}"


class Loop(threading.Thread):
    """One client calling ``call`` until stopped; records (status, seconds) per call."""

    def __init__(self, base: str, tenant: str, call: Any, pause_s: float = 0.0,
                 stop: Any = None) -> None:
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=base, timeout=300,
                                   headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        self.call = call
        self.pause_s = pause_s
        self.stop = stop or threading.Event()
        self.results: list[tuple[int, float]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                status = self.call(self.client).status_code
            except httpx.HTTPError:
                status = 0
            self.results.append((status, time.perf_counter() - start))
            time.sleep(self.pause_s)


def _flood(base: str, flooders: int, chars: int, polite: bool, ready: Any, stop: Any,
           out: Any) -> None:
    """Tenant a's clients, in a process of their own: the status of every call; ``polite``
    ones wait the ``Retry-After`` of a 429, the others call again at once."""
    def call(client: httpx.Client, body: bytes) -> httpx.Response:
        reply = client.post("/tokenize", content=body,
                            headers={"Content-Type": "application/json"})
        if polite and reply.status_code == 429:
            time.sleep(float(reply.headers.get("retry-after", "1")))
        return reply

    bodies = [json.dumps({"prompt": _text(chars, i)}).encode() for i in range(flooders)]
    loops = [Loop(base, "a", lambda c, b=b: call(c, b), stop=stop) for b in bodies]
    for loop in loops:
        loop.start()
    ready.set()
    for loop in loops:
        loop.join()
    out.put([status for loop in loops for status, _ in loop.results])


def _quantiles(results: list[tuple[int, float]]) -> dict[str, Any]:
    ok = sorted(s for status, s in results if status == 200)
    if not ok:
        return {"n": 0}
    p90 = ok[min(len(ok) - 1, int(len(ok) * 0.9))]
    return {"n": len(ok), "p50_s": round(statistics.median(ok), 3), "p90_s": round(p90, 3),
            "mean_s": round(statistics.fmean(ok), 3), "max_s": round(ok[-1], 3),
            "errors": sum(status != 200 for status, _ in results)}


def _cpu(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """CPU seconds so far of each process (the worker's with its output process)."""
    out = {}
    for name, proc in procs.items():
        family = [proc, *proc.children(recursive=True)] if name == "worker" else [proc]
        out[name] = sum(p.cpu_times().user + p.cpu_times().system for p in family)
    return out


def phase(base: str, seconds: float, flooders: int, chars: int,
          procs: dict[str, psutil.Process], polite: bool = False) -> dict[str, Any]:
    small = _text(60, 1)
    tok = Loop(base, "b", lambda c: c.post("/tokenize", json={"prompt": small}), 0.05)
    gen = Loop(base, "b", lambda c: c.post("/v1/completions", json={
        "prompt": "The ferry crossed the bay and", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}))
    ctx = mp.get_context("spawn")
    ready, stop, statuses = ctx.Event(), ctx.Event(), ctx.Queue()
    flood = ctx.Process(target=_flood, args=(base, flooders, chars, polite, ready, stop,
                                             statuses), daemon=True)
    if flooders:
        flood.start()
        ready.wait(300)  # its clients are calling (the process takes seconds to start)
        time.sleep(3.0)  # and their calls are queued
    for loop in (tok, gen):
        loop.start()
    cpu0, t0 = _cpu(procs | ({"flood": psutil.Process(flood.pid)} if flooders else {})), \
        time.perf_counter()
    time.sleep(seconds)
    cpu1, t1 = _cpu(procs | ({"flood": psutil.Process(flood.pid)} if flooders else {})), \
        time.perf_counter()
    for loop in (tok, gen):
        loop.stop.set()
    stop.set()
    for loop in (tok, gen):
        loop.join(300)
    answered = statuses.get(timeout=300) if flooders else []
    if flooders:
        flood.join(60)
    return {"b_tokenize": _quantiles(tok.results), "b_generation": _quantiles(gen.results),
            "a_answered": sum(s == 200 for s in answered),
            "a_429": sum(s == 429 for s in answered),
            "a_other": sum(s not in (200, 429) for s in answered),
            "cpu_cores": {k: round((cpu1[k] - cpu0[k]) / (t1 - t0), 2) for k in cpu0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=ROOT)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--flooders", type=int, default=24)
    parser.add_argument("--chars", type=int, default=395_000)
    parser.add_argument("--name", default="tokenizer_flood")
    parser.add_argument("--polite", action="store_true",
                        help="also a phase whose flood waits the Retry-After of each 429")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        redis_proc, url = start_redis(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs, base = _start(args.src.resolve(), url, tmp)
            watched = {"gateway": psutil.Process(procs[0].pid),
                       "worker": psutil.Process(procs[1].pid),
                       "redis": psutil.Process(redis_proc.pid),
                       "clients": psutil.Process()}
            rows = {"quiet": phase(base, args.seconds, 0, args.chars, watched),
                    "flood": phase(base, args.seconds, args.flooders, args.chars, watched)}
            if args.polite:
                rows["polite"] = phase(base, args.seconds, args.flooders, args.chars,
                                       watched, polite=True)
        finally:
            for proc in [*procs, redis_proc]:
                _stop(proc)
    print(f"{'phase':<6} {'b /tokenize p50 (p90)':>24} {'b generation p50 (p90)':>24} "
          f"{'a answered':>11} {'a 429s':>7}")
    for name, row in rows.items():
        t, g = row["b_tokenize"], row["b_generation"]
        print(f"{name:<6} {t.get('p50_s', '-'):>14} ({t.get('p90_s', '-')}) n={t['n']:<4}"
              f"{g.get('p50_s', '-'):>11} ({g.get('p90_s', '-')}) n={g['n']:<4}"
              f"{row['a_answered']:>8} {row['a_429']:>7}")
        print(f"{'':<6} max {t.get('max_s', '-')} / {g.get('max_s', '-')} s; cpu cores "
              f"{row['cpu_cores']}")
    out = {"src": str(args.src), "seconds": args.seconds, "flooders": args.flooders,
           "chars": args.chars, "cpus": os.cpu_count(), **rows}
    path = ROOT / "ops" / "bench" / "results" / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"written: {path}")


if __name__ == "__main__":
    main()
