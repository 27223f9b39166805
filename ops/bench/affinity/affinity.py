"""Prefix affinity on a real stack: ``ferry up --workers 2`` (CPU, the default model), the
conversations driven through the Redis client library (the producer side that marks).

Phases, one stack, each on conversations of its own (so no phase feeds another's cache):

* ``off``: N conversations x T turns, a ~1,000-token system prompt of its own each and a
  growing history (each turn's messages hold the previous answers, 128 tokens each by
  default, ``--answer-tokens``), affinity off;
* ``on``: the same shape, affinity on;
* ``single``: the same shape, every request offered to one worker with an unbounded
  steal time: what one worker alone serves from its cache (the 0.9x reference);
* ``skewed``: one system prompt shared by every conversation (a hot prefix), affinity on:
  the share of the tokens each worker computed;
* ``kill``: the ``on`` phase's conversations again (same texts, same seeds), affinity on,
  one worker ``kill -9``ed once half the turns are done: every request must finish with
  the ``on`` phase's output, and none may wait past the steal bound plus its own run.

Each conversation runs its turns one after another (``--think-s``: with a seeded pause
before each next turn, 1 s on average by default), the conversations at once. Numbers
per phase: prompt tokens served from the cache in turns 2..T, time to first token of
turns 2..T measured by the client (from just before the enqueue, the producer's affinity
look-up included, to the first token's event), and throughput (prompt + completion
tokens per wall second); and, from the workers' ``request_timeline`` debug lines, each
later turn's TTFT in parts (queue, prepare, mailbox, engine wait, prefill step) by route
and for hits and misses. Writes
``ops/bench/results/affinity.json``::

    .venv/bin/python ops/bench/affinity/affinity.py                    # 16 x 4
    .venv/bin/python ops/bench/affinity/affinity.py --conversations 8  # a loaded machine
    .venv/bin/python ops/bench/affinity/affinity.py --kv-blocks 640 \
        --out ops/bench/results/affinity_full_cache.json           # caches that fill up
    .venv/bin/python ops/bench/affinity/affinity.py --think-s 0 \
        --out ops/bench/results/affinity_closed.json               # a closed loop
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from ferry.local_stack import free_port  # noqa: E402
from ops.bench.affinity.tables import breakdown, report, summarize, timelines  # noqa: E402
from ops.bench.affinity.workload import conversation, send, system_prompt  # noqa: E402
from ops.bench.service import ferry_up  # noqa: E402
from protocol.affinity.mark import mark  # noqa: E402
from protocol.affinity.router import AffinitySettings, Router  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.codec import decode_heartbeat  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import GenerateRequest, SamplingParams  # noqa: E402
from protocol.store import as_str  # noqa: E402

RESULT = ROOT / "ops" / "bench" / "results" / "affinity.json"


class Pinned(Router):
    """Offers every request to one worker, with no steal: one worker alone."""

    def __init__(self, worker: str) -> None:
        super().__init__(Keys(), AffinitySettings(enabled=True))
        self.worker = worker

    def mark_for(self, redis_client: Any, request: GenerateRequest) -> bytes:
        now = int(time.time() * 1000)
        return mark(self.worker, now, now + 3_600_000)


def run_phase(url: str, name: str, systems: list[str], turns: int, router: Router,
              answer_tokens: int, on_turn: Any = None, tag: str | None = None,
              think_s: float = 0.0) -> dict[str, Any]:
    """Every conversation in its own thread; returns the per-request records. With
    ``think_s`` each conversation pauses before each next turn, for between 0.5x and
    1.5x ``think_s`` (seeded by conversation and turn: the same pauses in every phase)."""
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(c: int) -> None:
        client = FerryClient(redis.Redis.from_url(url))
        client.router = router
        answers: list[str] = []
        for t in range(1, turns + 1):
            if t > 1 and think_s > 0:
                time.sleep(think_s * random.Random(1000 * c + t).uniform(0.5, 1.5))
            req = conversation(f"{tag or name}{c}", systems[c], t, answers, seed=1000 * c,
                               answer_tokens=answer_tokens)
            status, first = send(client, req)
            answers.append(status.text)
            u, tm = status.usage, status.timings
            rec = {"conv": c, "turn": t, "id": req.request_id, "worker": status.worker_id,
                   "text": status.text, "state": status.state,
                   "prompt": u.prompt_tokens if u else 0,
                   "cached": u.cached_tokens if u else 0,
                   "completion": u.completion_tokens if u else 0,
                   "ttft_s": first, "worker_ttft_s": tm.ttft_s if tm else None,
                   "queued_s": tm.queued_s if tm else None,
                   "total_s": tm.total_s if tm else None}
            with lock:
                records.append(rec)
            if on_turn is not None:
                on_turn(len(records))
        client.close()

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(c,)) for c in range(len(systems))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"records": records, "wall_s": time.monotonic() - start}


def start_stack(tmp: Path, workers: int, kv_blocks: int) -> tuple[subprocess.Popen[bytes],
                                                  subprocess.Popen[bytes], str, str]:
    """A redis-server of the bench's own and ``ferry up --workers N`` on it, ready."""
    rport = free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                                   "--appendonly", "no", "--dir", str(tmp)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{rport}/0"
    env = dict(os.environ, FERRY_DEVICE="cpu", FERRY_KV_CACHE_BLOCKS=str(kv_blocks),
               FERRY_PREFIX_AFFINITY="1", FERRY_LOG_LEVEL="debug")  # request_timeline
    up, base = ferry_up.start_ferry(env, tmp / "up.log", workers, ["--redis-url", url],
                                    ready_s=900)
    return up, redis_proc, url, base


def routes(r: Any, keys: Keys) -> dict[str, dict[str, int]]:
    """Every live worker's affinity counters, from its heartbeat."""
    out = {}
    for w in sorted(x.decode() for x in r.smembers(keys.workers)):
        raw = r.get(keys.worker(w))
        if raw:
            stats = decode_heartbeat(raw).stats
            out[w] = {k: int(stats.get(f"affinity_{k}", 0))
                      for k in ("pulled", "stolen", "unmarked")}
    return out


def routed(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
           ) -> dict[str, int]:
    """Requests pulled during a phase, fleet-wide, by route (a restarted worker counts
    from zero)."""
    total = dict.fromkeys(("pulled", "stolen", "unmarked"), 0)
    for w, counts in after.items():
        for k, v in counts.items():
            total[k] += v - before.get(w, {}).get(k, 0)
    return total


def resume_times(url: str, keys: Keys, dead: str, killed_at: float,
                 out: dict[str, Any]) -> None:
    """The requests ``dead`` held when it was killed (taken, running or queued) and how
    long after the kill each was taken over by another worker (its job's worker id
    changes): the supervisor's hand-back plus a survivor's reaper pass."""
    r = redis.Redis.from_url(url)
    held = []
    for key in r.scan_iter(match=keys.job("*"), count=1000):
        state, worker = r.hmget(key, "state", "worker_id")
        if as_str(worker) == dead and as_str(state) not in ("done", "failed", "cancelled"):
            held.append(key)
    waits: dict[Any, float] = {}
    while len(waits) < len(held) and time.monotonic() < killed_at + 120:
        for key in held:
            if key not in waits and as_str(r.hget(key, "worker_id")) != dead:
                waits[key] = round(time.monotonic() - killed_at, 2)
        time.sleep(0.02)
    out.update(held=len(held), resumed=len(waits), after_s=sorted(waits.values()))
    r.close()


def worker_pid(up_pid: int, index: int) -> int:
    """The live process of worker ``index`` of the ``ferry up`` with pid ``up_pid``."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if f"up-{up_pid}-{index}" in args and " worker" in args:
            return int(pid)
    raise RuntimeError(f"worker {index} of {up_pid} not found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=560)  # ~1,000 tokens
    parser.add_argument("--steal-ms", type=int, default=250)
    parser.add_argument("--phases", default="off,on,single,skewed,kill")
    # 4096 blocks of 16 tokens hold every conversation on both workers; 640 hold the
    # eight conversations a worker runs at once and little more: a full cache, as a busy
    # fleet's is
    parser.add_argument("--kv-blocks", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    # > 0: users who read and type (a seeded pause of 0.5-1.5x this before each next
    # turn), so hits and misses arrive mixed as they do in service; 0: a closed loop
    # (each next turn the moment the last one ends), where conversations that hit run
    # ahead of those that miss and rarely share a step with them (docs/affinity.md)
    parser.add_argument("--think-s", type=float, default=1.0)
    # each turn's answer: a few sentences, so the history grows as a chat's does (16: a
    # history that barely grows, where a turn on the other worker recomputes ~40 tokens)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    rng = random.Random(0)
    n, turns = args.conversations, args.turns
    sets = {p: [f"[{p} {c}] " + system_prompt(rng, args.system_words) for c in range(n)]
            for p in ("off", "on", "single")}
    hot = system_prompt(rng, args.system_words)
    sets["skewed"] = [hot] * n
    sets["kill"] = sets["on"]
    started, results, phases = time.monotonic(), {}, {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        up, redis_proc, url, _base = start_stack(tmp, args.workers, args.kv_blocks)
        try:
            r = redis.Redis.from_url(url)
            keys = FerryClient(r).keys
            workers = sorted(w.decode() if isinstance(w, bytes) else w
                             for w in r.smembers(keys.workers))
            warm = FerryClient(r, affinity=AffinitySettings(enabled=False))
            for i in range(4):  # one-time costs out of the way
                warm.generate(GenerateRequest(prompt=f"warm {i} " * 50, params=SamplingParams(
                    max_tokens=4)), timeout=600)
            for p in args.phases.split(","):
                settings = AffinitySettings(enabled=p != "off", steal_ms=args.steal_ms)
                router: Router = Pinned(workers[0]) if p == "single" else \
                    Router(keys, settings)
                hook = None
                resumed: dict[str, Any] = {}
                if p == "kill":
                    total, fired = n * turns, threading.Event()

                    def hook(done: int, total: int = total, fired: threading.Event = fired,
                             resumed: dict[str, Any] = resumed) -> None:
                        if done >= total // 2 and not fired.is_set():
                            fired.set()
                            pid = worker_pid(up.pid, 0)
                            os.kill(pid, signal.SIGKILL)
                            watch = threading.Thread(target=resume_times, args=(
                                url, keys, workers[0], time.monotonic(), resumed))
                            watch.start()
                            print(f"kill -9 of worker 0 (pid {pid}) after {done} requests",
                                  flush=True)
                print(f"phase {p} ...", flush=True)
                before = routes(r, keys)
                phases[p] = run_phase(url, p, sets[p], turns, router, args.answer_tokens,
                                      hook, tag="on" if p == "kill" else p,
                                      think_s=args.think_s)
                time.sleep(1.5)  # a heartbeat after the last request
                results[p] = summarize(phases[p])
                results[p]["routes"] = routed(before, routes(r, keys))
                if resumed:
                    results[p]["resumed"] = resumed
                print(p, json.dumps({k: v for k, v in results[p].items()}), flush=True)
        finally:
            ferry_up.stop_ferry(up)
            redis_proc.kill()
        traces = timelines(tmp / "up.log")
    for p, phase in phases.items():
        for rec in phase["records"]:
            rec["trace"] = traces.get(rec["id"])
        results[p]["ttft_parts_turns_2_on"] = breakdown(phase["records"])
    out = report(results, phases, args)
    out.update({"seconds": round(time.monotonic() - started, 1), "cpus": os.cpu_count(),
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
