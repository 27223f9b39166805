"""Prefix affinity on a real stack: ``ferry up --workers 2`` (CPU, the default model), the
conversations driven through the Redis client library (the producer side that marks).

Phases, one stack, each on conversations of its own (so no phase feeds another's cache):

* ``off``: N conversations x T turns, a ~1,000-token system prompt of its own each and a
  growing history (each turn's messages hold the previous answers), affinity off;
* ``on``: the same shape, affinity on;
* ``single``: the same shape, every request offered to one worker with an unbounded
  steal time: what one worker alone serves from its cache (the 0.9x reference);
* ``skewed``: one system prompt shared by every conversation (a hot prefix), affinity on:
  the share of the tokens each worker computed;
* ``kill``: the ``on`` phase's conversations again (same texts, same seeds), affinity on,
  one worker ``kill -9``ed once half the turns are done: every request must finish with
  the ``on`` phase's output, and none may wait past the steal bound plus its own run.

Each conversation runs its turns one after another (``--think-s``: with a pause before
each next turn), the conversations at once. Numbers per phase: prompt tokens served from
the cache in turns 2..T, time to first token of turns 2..T measured by the client (from
just before the enqueue, the producer's affinity look-up included, to the first token's
event), and throughput (prompt + completion tokens per wall second); and, from the
workers' ``request_timeline`` debug lines, each later turn's TTFT in parts (queue,
prepare, mailbox, engine wait, prefill step) by route and for hits and misses. Writes
``ops/bench/results/affinity.json``::

    .venv/bin/python ops/bench/affinity/affinity.py                    # 16 x 4
    .venv/bin/python ops/bench/affinity/affinity.py --conversations 8  # a loaded machine
    .venv/bin/python ops/bench/affinity/affinity.py --kv-blocks 640 \
        --out ops/bench/results/affinity_full_cache.json           # caches that fill up
    .venv/bin/python ops/bench/affinity/affinity.py --think-s 1 \
        --out ops/bench/results/affinity_paced.json                # users who pause
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
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

import redis  # noqa: E402

from ferry.local_stack import free_port  # noqa: E402
from ops.bench.service import ferry_up  # noqa: E402
from protocol.affinity.mark import mark  # noqa: E402
from protocol.affinity.router import AffinitySettings, Router  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.codec import decode_heartbeat  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import (  # noqa: E402
    ChatMessage,
    GenerateRequest,
    JobStatus,
    SamplingParams,
    TokenEvent,
)
from protocol.store import as_str  # noqa: E402
from protocol.streaming import status_from_events  # noqa: E402

RESULT = ROOT / "ops" / "bench" / "results" / "affinity.json"
WORDS = ["queue", "lease", "worker", "stream", "tenant", "prefix", "cache", "block", "token",
         "batch", "prefill", "decode", "replica", "shard", "heartbeat", "cancel", "deadline",
         "priority", "lane", "backlog", "fair", "share"]


class Pinned(Router):
    """Offers every request to one worker, with no steal: one worker alone."""

    def __init__(self, worker: str) -> None:
        super().__init__(Keys(), AffinitySettings(enabled=True))
        self.worker = worker

    def mark_for(self, redis_client: Any, request: GenerateRequest) -> bytes:
        now = int(time.time() * 1000)
        return mark(self.worker, now, now + 3_600_000)


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are the operations assistant. Context: " + " ".join(
        rng.choice(WORDS) for _ in range(words)) + "."


def conversation(tag: str, system: str, turns: int, answers: list[str], seed: int
                 ) -> GenerateRequest:
    msgs = [ChatMessage(role="system", content=system)]
    for t in range(turns):
        msgs.append(ChatMessage(role="user", content=f"({tag}) Question {t}: what happens "
                                f"to the request when step {t} fails?"))
        if t < turns - 1:
            msgs.append(ChatMessage(role="assistant", content=answers[t]))
    return GenerateRequest(messages=msgs, request_id=f"{tag}-t{turns}-{time.time_ns()}",
                           params=SamplingParams(max_tokens=16, temperature=0.8,
                                                 seed=seed + turns, ignore_eos=True))


def send(client: FerryClient, req: GenerateRequest) -> tuple[JobStatus, float | None]:
    """Send one request and follow its stream: its result, and the seconds from the send
    (the producer's affinity look-up and push included) to its first token's event."""
    events: list[TokenEvent] = []
    first = None
    with client.subscribe(req.request_id) as sub:
        sent = time.monotonic()
        client.enqueue(req)
        for event in sub.events(900):
            if first is None and event.token_ids:
                first = time.monotonic() - sent
            events.append(event)
    return status_from_events(req, events), first


def run_phase(url: str, name: str, systems: list[str], turns: int, router: Router,
              on_turn: Any = None, tag: str | None = None, think_s: float = 0.0
              ) -> dict[str, Any]:
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
            req = conversation(f"{tag or name}{c}", systems[c], t, answers, seed=1000 * c)
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


def summarize(phase: dict[str, Any]) -> dict[str, Any]:
    recs = phase["records"]
    later = [r for r in recs if r["turn"] >= 2]
    tokens = sum(r["prompt"] + r["completion"] for r in recs)
    ttft = sorted(r["ttft_s"] for r in later if r["ttft_s"] is not None)
    per_worker: dict[str, int] = {}
    for r in recs:  # the tokens each worker computed (prefill not served from cache + decode)
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + \
            r["prompt"] - r["cached"] + r["completion"]
    done = sum(per_worker.values()) or 1
    return {
        "requests": len(recs), "finished": sum(r["state"] == "done" for r in recs),
        "cached_tokens_turns_2_on": sum(r["cached"] for r in later),
        "prompt_tokens_turns_2_on": sum(r["prompt"] for r in later),
        "ttft_median_s_turns_2_on": statistics.median(ttft),
        "ttft_mean_s_turns_2_on": statistics.mean(ttft),
        "ttft_p90_s_turns_2_on": ttft[int(0.9 * (len(ttft) - 1))],
        # turns 2.. that found less than half their prompt cached: recomputed elsewhere
        "misses_turns_2_on": sum(r["cached"] < r["prompt"] / 2 for r in later),
        "throughput_tok_s": tokens / phase["wall_s"], "wall_s": phase["wall_s"],
        "computed_share": {w: round(n / done, 3) for w, n in sorted(per_worker.items())},
        "max_queued_s": max((r["queued_s"] or 0) for r in recs),
    }


PARTS = ("queue_s", "prepare_s", "mailbox_s", "engine_wait_s", "prefill_s")


def timelines(log: Path) -> dict[str, dict[str, Any]]:
    """The workers' ``request_timeline`` lines (``worker/service/ttft_trace.py``, logged
    at debug level) by request id."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if "request_timeline" in line and "{" in line:
            try:
                event = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            out[str(event.get("request_id"))] = event
    return out


def breakdown(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns 2..T: each part of the time to first token (median and mean), overall, per
    route (offered to its holder and taken there, stolen by the other worker after the
    steal time, unmarked) and for cache hits and misses."""
    later = [r for r in records if r["turn"] >= 2 and r.get("trace")]
    steps: dict[tuple[str, float], int] = {}  # (worker, step start) -> requests it started
    for r in records:
        if r.get("trace"):
            step = (r["trace"]["worker"], r["trace"]["scheduled_at"])
            steps[step] = steps.get(step, 0) + 1

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {"n": 0}
        out: dict[str, Any] = {"n": len(rows)}
        for part in (*PARTS, "ttft_s"):
            xs = [r["trace"][part] for r in rows]
            out[part] = {"median": round(statistics.median(xs), 4),
                         "mean": round(statistics.mean(xs), 4)}
        client = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        if client:
            out["client_ttft_s"] = {"median": round(statistics.median(client), 4),
                                    "mean": round(statistics.mean(client), 4)}
        together = [steps[(r["trace"]["worker"], r["trace"]["scheduled_at"])] for r in rows]
        out["first_scheduled_with"] = {"median": statistics.median(together),
                                       "mean": round(statistics.mean(together), 2)}
        waits = [r["trace"]["mark_wait_s"] for r in rows
                 if r["trace"].get("mark_wait_s") is not None]
        if waits:
            out["mark_wait_s"] = {"median": round(statistics.median(waits), 4),
                                  "max": round(max(waits), 4)}
        return out

    by_route: dict[str, list[dict[str, Any]]] = {}
    for r in later:
        by_route.setdefault(r["trace"]["route"], []).append(r)
    return {"all": stats(later), "routes": {k: stats(v) for k, v in sorted(by_route.items())},
            "hits": stats([r for r in later if r["cached"] >= r["prompt"] / 2]),
            "misses": stats([r for r in later if r["cached"] < r["prompt"] / 2])}


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
    # 0: a closed loop (each next turn is sent the moment the last one ends); > 0: users
    # who read and type, so the offered load is the same with affinity on and off
    parser.add_argument("--think-s", type=float, default=0.0)
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
                phases[p] = run_phase(url, p, sets[p], turns, router, hook,
                                      tag="on" if p == "kill" else p, think_s=args.think_s)
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


def report(results: dict[str, Any], phases: dict[str, Any], args: Any) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    on, off, single = results.get("on"), results.get("off"), results.get("single")
    if on and single:
        checks["cached_vs_one_worker"] = round(
            on["cached_tokens_turns_2_on"] / max(1, single["cached_tokens_turns_2_on"]), 3)
    if on and off:
        for stat in ("median", "mean", "p90"):
            checks[f"ttft_{stat}_on_vs_off"] = round(on[f"ttft_{stat}_s_turns_2_on"]
                                                     / off[f"ttft_{stat}_s_turns_2_on"], 3)
        checks["throughput_on_vs_off"] = round(on["throughput_tok_s"]
                                               / off["throughput_tok_s"], 3)
    if "skewed" in results:
        checks["skewed_computed_share"] = results["skewed"]["computed_share"]
    if "kill" in results and "on" in phases:
        undisturbed = {(r["conv"], r["turn"]): r["text"] for r in phases["on"]["records"]}
        killed = {(r["conv"], r["turn"]): r["text"] for r in phases["kill"]["records"]}
        checks["kill_all_finished"] = results["kill"]["finished"] == results["kill"]["requests"]
        checks["kill_outputs_identical"] = sum(undisturbed.get(k) == v for k, v in killed.items())
        checks["kill_requests"] = len(killed)
        checks["kill_max_queued_s"] = results["kill"]["max_queued_s"]
        checks["kill_held_requests_resumed_after_s"] = results["kill"].get("resumed")
    print(f"{'phase':8} {'cached t2+':>10} {'of prompt':>10} {'misses':>6} {'ttft p50':>8} "
          f"{'mean':>6} {'p90':>6} {'tok/s':>8} {'wall s':>7}  computed share")
    for p, s in results.items():
        print(f"{p:8} {s['cached_tokens_turns_2_on']:10d} {s['prompt_tokens_turns_2_on']:10d} "
              f"{s['misses_turns_2_on']:6d} {s['ttft_median_s_turns_2_on']:8.3f} "
              f"{s['ttft_mean_s_turns_2_on']:6.3f} {s['ttft_p90_s_turns_2_on']:6.3f} "
              f"{s['throughput_tok_s']:8.1f} {s['wall_s']:7.1f}  {s['computed_share']} "
              f"{s['routes']}")
    print("time to first token, turns 2..T, median / mean s: " + ", ".join(PARTS))
    for p, s in results.items():
        parts = s.get("ttft_parts_turns_2_on", {})
        for group, st in [("all", parts.get("all", {})), *parts.get("routes", {}).items(),
                          ("hits", parts.get("hits", {})), ("misses", parts.get("misses", {}))]:
            if st.get("n"):
                cells = " ".join(f"{st[k]['median']:.3f}/{st[k]['mean']:.3f}" for k in PARTS)
                print(f"{p:8} {group:9} n={st['n']:2d} {cells}  worker ttft "
                      f"{st['ttft_s']['median']:.3f}  client "
                      f"{st.get('client_ttft_s', {}).get('median', float('nan')):.3f}"
                      f"  mark wait {st.get('mark_wait_s')}  started with "
                      f"{st['first_scheduled_with']}")
    print(json.dumps(checks, indent=1))
    return {"bench": "affinity", "conversations": args.conversations, "turns": args.turns,
            "workers": args.workers, "think_s": args.think_s,
            "kv_blocks": args.kv_blocks,
            "system_words": args.system_words, "steal_ms": args.steal_ms, "model": "default",
            "device": "cpu", "phases": results, "checks": checks,
            "records": {p: [record(r) for r in ph["records"]] for p, ph in phases.items()}}


def record(r: dict[str, Any]) -> dict[str, Any]:
    """One request as the results file keeps it: no text, and of its timeline the route
    and the parts only."""
    out = {k: v for k, v in r.items() if k not in ("text", "trace")}
    trace = r.get("trace")
    if trace:
        out["trace"] = {k: trace.get(k) for k in ("route", "mark_wait_s", *PARTS)}
    return out


if __name__ == "__main__":
    main()
