"""Service benchmark: Ferry in-process vs. Ferry end to end, same model and workload as
``ops/bench/engine/engine.py`` (64 streams opened at once), one run.

Rows: the engine in-process (one torch thread); one worker process (``run_worker``, as
``ferry worker``, one torch thread) fed by the Redis client; one such worker behind
``ferry gateway`` with 64 OpenAI streaming completions (``service_clients.py``); then the
scaling pair, one and two workers behind the gateway with 2 x (max_num_seqs + prefetch)
= 136 requests, so each of the two workers has a full batch to work on.
Reports output tokens/s (goal: gateway path >= 0.95x in-process), the latency the service
adds per token (client receive time minus the engine loop's step-end time, from a trace
the bench's workers write; goal p99 < 5 ms), two workers against one (goal >= 1.8x: needs
two free cores besides the gateway, Redis and the client), identical outputs, and the
gateway's enqueue rate with a consumer that only acknowledges. Writes
``ops/bench/results/service.json``. Usage:

    .venv/bin/python ops/bench/service/service.py --quick    # 16 requests, max_num_seqs 8
    .venv/bin/python ops/bench/service/service.py            # 64 requests, 136 in the pair
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402

from ferry.local_stack import Stack, free_port  # noqa: E402
from ops.bench.engine.engine import run_ferry  # noqa: E402
from ops.bench.engine.workload import Job, build_bench_model, main_workload  # noqa: E402
from ops.bench.service.service_clients import http_streams, redis_streams, requests_for  # noqa: E402
from protocol.client import FerryClient  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402
from protocol.store import ensure_group  # noqa: E402
from protocol.tenants import fair  # noqa: E402
from worker.service.redis.connection import WorkerSettings  # noqa: E402

ENGINE_KW = dict(max_num_seqs=64, max_num_batched_tokens=1024, num_blocks=3300)
FERRY = [sys.executable, "-m", "ferry.cli"]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_service(path: str, jobs: list[Job], workers: int, tmp: Path, via: str,
                max_num_seqs: int) -> dict[str, Any]:
    """``workers`` worker processes on a fresh Redis, clients ``via`` "redis" or "gateway"."""
    stack = Stack(tmp)
    prefix = "ferry"
    env = dict(os.environ, FERRY_TORCH_THREADS="1", FERRY_DEVICE="cpu", FERRY_PREFIX=prefix,
               FERRY_KV_CACHE_BLOCKS=str(ENGINE_KW["num_blocks"]),
               FERRY_MAX_NUM_SEQS=str(max_num_seqs),
               FERRY_MAX_NUM_BATCHED_TOKENS=str(ENGINE_KW["max_num_batched_tokens"]))
    traces = [tmp / f"trace-{via}-{workers}-{i}.txt" for i in range(workers)]
    try:
        url = stack.start_redis()
        for i, trace in enumerate(traces):
            trace.unlink(missing_ok=True)
            stack.spawn(f"worker-{i}", [sys.executable, __file__, "--worker", path, url,
                                        f"bench-{i}", str(trace)], env)
        base = _start_gateway(stack, url) if via == "gateway" else None
        r = redis.Redis.from_url(url)
        while r.scard(f"{prefix}:workers") < workers:
            stack.check_alive()
            time.sleep(0.2)

        def drive(requests: list[GenerateRequest]) -> dict[str, Any]:
            if base is not None:
                return asyncio.run(http_streams(base, requests))
            return asyncio.run(redis_streams(url, prefix, requests))

        drive(requests_for([Job(j.prompt[:64], 8) for j in jobs[: 4 * workers]], "warm"))
        result = drive(requests_for(jobs, "req"))
        client = FerryClient.from_url(url, prefix=prefix)
        statuses = [client.result(f"req-{i}") for i in range(len(jobs))]
        result["tokens"] = {f"req-{i}": s.token_ids if s else [] for i, s in enumerate(statuses)}
    finally:
        stack.stop()
    emitted, per_worker = {}, []
    for trace in traces:
        served = set()
        for line in trace.read_text().splitlines():
            rid, seq, t_emit, t_sent = line.split()
            emitted[(rid, int(seq))] = (float(t_emit), float(t_sent))
            if rid.startswith("req-"):
                served.add(rid)
        per_worker.append(len(served))
    added = [(t - emitted[k][0]) * 1000 for k, t in result["arrivals"].items() if k in emitted]
    outbox = [(s - e) * 1000 for e, s in emitted.values()]
    return {**result, "added_ms": added, "outbox_ms": outbox, "requests_per_worker": per_worker}


def _start_gateway(stack: Stack, url: str) -> str:
    import httpx

    port = free_port()
    stack.spawn("gateway", [*FERRY, "gateway", "--redis-url", url, "--host", "127.0.0.1",
                            "--port", str(port), "--log-level", "warning"], dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/healthz").status_code == 200:
                return base
        except httpx.HTTPError:
            stack.check_alive()
            time.sleep(0.2)


def worker_mode(path: str, url: str, worker_id: str, trace: str) -> int:
    """A ``ferry worker`` (same ``run_worker``, settings from the same FERRY_* variables)
    that also writes ``request_id seq emitted_at sent_at`` per event it sends."""
    from worker.engine.config import EngineConfig
    from worker.service.main import run_worker
    from worker.service.redis.connection import WorkerSettings

    out = open(trace, "w", buffering=1 << 20)  # noqa: SIM115 - closed below

    def observe(batch: list[Any], sent_at: float) -> None:
        out.write("".join(f"{o.request_id} {o.seq} {o.emitted_at:.6f} {sent_at:.6f}\n"
                          for o in batch))

    # the trace sees what this process's outbox sends: the events made in-process (an
    # output process's own outbox is out of the observer's reach)
    settings = WorkerSettings(redis_url=url, prefix=os.environ["FERRY_PREFIX"],
                              worker_id=worker_id, output_process=False)
    try:
        config = EngineConfig.from_env(path)
        return run_worker(config, settings, torch_threads=1,
                          log_level="warning", observer=observe)
    finally:
        out.close()


def enqueue_rate(n: int, concurrency: int, tmp: Path) -> dict[str, float]:
    """POST /v1/jobs against ``ferry gateway`` while a consumer only XACKs."""
    import httpx

    stack = Stack(tmp)
    try:
        url, port = stack.start_redis(), free_port()
        stack.spawn("gateway", [*FERRY, "gateway", "--redis-url", url, "--host", "127.0.0.1",
                                "--port", str(port), "--log-level", "warning"],
                    dict(os.environ, FERRY_MAX_QUEUE_LAG="none"))
        base = f"http://127.0.0.1:{port}"
        while True:  # not ready (no worker), but answering
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                stack.check_alive()
                time.sleep(0.2)
        stop = threading.Event()
        acked = [0]

        def consume() -> None:
            r = redis.Redis.from_url(url)
            ensure_group(r, Keys())
            while not stop.is_set():
                entries, _marks = fair.pull(r, "ferry:requests", "ferry-workers", "acker", 512)
                if not entries:
                    time.sleep(0.1)
                    continue
                ids = [entry[0] for entry in entries]
                r.xack("ferry:requests", "ferry-workers", *ids)
                acked[0] += len(ids)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()

        async def post_all() -> float:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> None:
                    async with sem:
                        resp = await http.post("/v1/jobs", json={"prompt": f"p{i}"})
                        assert resp.status_code == 202, resp.text

                start = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(n)))
                return time.perf_counter() - start

        elapsed = asyncio.run(post_all())
        time.sleep(0.3)
        stop.set()
        consumer.join(2)
    finally:
        stack.stop()
    return {"requests": n, "concurrency": concurrency, "seconds": round(elapsed, 3),
            "requests_per_s": round(n / elapsed, 1), "acknowledged": acked[0]}


RUNS = [("1 worker via Redis client", "redis", 1, "main"),
        ("1 worker via gateway (SSE)", "gateway", 1, "main"),
        ("1 worker via gateway, scaling pair", "gateway", 1, "scale"),
        ("2 workers via gateway, scaling pair", "gateway", 2, "scale")]
"""The scaling pair runs 2 * (max_num_seqs + prefetch) requests, so that with two workers
each still has a full batch (at least max_num_seqs requests) at saturation even when the
intake's read-ahead splits them unevenly: the old pair split the 64-request workload over
two workers and so compared a full batch with two half ones."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, max_num_seqs 8 (24 requests in the scaling pair)")
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/service.json"))
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "URL", "ID", "TRACE"),
                    help=argparse.SUPPRESS)  # internal: the worker processes of this bench
    args = ap.parse_args()
    if args.worker:
        sys.exit(worker_mode(*args.worker))
    torch.set_num_threads(1)  # the same budget as each worker process
    path = build_bench_model()
    seqs = 8 if args.quick else ENGINE_KW["max_num_seqs"]
    engine_kw = {**ENGINE_KW, "max_num_seqs": seqs}
    workloads = {"main": main_workload(16 if args.quick else 64),
                 "scale": main_workload(2 * (seqs + WorkerSettings().prefetch), seed=1)}
    jobs = workloads["main"]
    useful = {name: sum(j.max_tokens for j in w) for name, w in workloads.items()}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferry-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    run_ferry(path, jobs[:4], **engine_kw)  # warm-up
    start = time.perf_counter()
    ref = run_ferry(path, jobs, **engine_kw)
    inproc_s = time.perf_counter() - start
    print(f"in-process: {inproc_s:.2f}s {useful['main'] / inproc_s:.1f} tok/s", flush=True)
    rows, scale_tokens = [], {}
    for name, via, workers, load in RUNS:
        res = run_service(path, workloads[load], workers, tmp, via, seqs)
        n = len(workloads[load])
        if load == "scale":
            scale_tokens[workers] = res["tokens"]
        rows.append({
            "system": name, "via": via, "workers": workers, "requests": n,
            "seconds": round(res["elapsed"], 2),
            "tok_s": round(useful[load] / res["elapsed"], 1),
            "vs_in_process": round(inproc_s / res["elapsed"], 3) if load == "main" else None,
            "added_latency_ms": _spread(res["added_ms"]), "outbox_ms": _spread(res["outbox_ms"]),
            "requests_per_worker": res["requests_per_worker"],
            "identical_outputs": sum(res["tokens"][f"req-{i}"] == ref[i] for i in range(n))
            if load == "main" else None,
        })
        print(f"{name}: {res['elapsed']:.2f}s {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    one = next(r for r in rows if r["system"] == RUNS[2][0])
    two = next(r for r in rows if r["system"] == RUNS[3][0])
    result = {
        "requests": len(jobs), "output_tokens": useful["main"], "torch_threads_per_engine": 1,
        "max_num_seqs": seqs, "cpus": os.cpu_count(),
        "in_process_tok_s": round(useful["main"] / inproc_s, 1), "runs": rows,
        "ratio_two_vs_one_worker": round(two["tok_s"] / one["tok_s"], 3),
        "two_workers_each_saturated": min(two["requests_per_worker"]) >= seqs,
        "scaling_outputs_identical": scale_tokens.get(1) == scale_tokens.get(2),
        "gateway_enqueue": enqueue_rate(300 if args.quick else 2000, 32, tmp),
    }
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def _spread(values: list[float]) -> dict[str, float]:
    return {"p50": round(_pct(values, 0.5), 2), "p99": round(_pct(values, 0.99), 2),
            "events": len(values)}


def table(r: dict[str, Any]) -> str:
    lines = [f"{'system':<48} {'reqs':>4} {'tok/s':>7} {'vs in-proc':>10} {'added p50':>10} "
             f"{'added p99':>10} {'outbox p99':>10} {'per worker':>10} {'identical':>10}",
             f"{'in-process engine (1 thread)':<48} {r['requests']:>4} "
             f"{r['in_process_tok_s']:>7.1f}"]
    for row in r["runs"]:
        lat, box = row["added_latency_ms"], row["outbox_ms"]
        ratio = f"{row['vs_in_process']:>9.3f}x" if row["vs_in_process"] else f"{'':>10}"
        same = f"{row['identical_outputs']:>6}/{row['requests']}" \
            if row["identical_outputs"] is not None else ""
        lines.append(f"{row['system']:<48} {row['requests']:>4} {row['tok_s']:>7.1f} {ratio} "
                     f"{lat['p50']:>8.2f}ms {lat['p99']:>8.2f}ms {box['p99']:>8.2f}ms "
                     f"{'/'.join(map(str, row['requests_per_worker'])):>10} {same}")
    gw = r["gateway_enqueue"]
    lines += [f"2 workers / 1 worker (gateway, {r['runs'][-1]['requests']} requests): "
              f"{r['ratio_two_vs_one_worker']:.2f}x (goal >= 1.8; {r['cpus']} cpus; each worker "
              f"saturated: {r['two_workers_each_saturated']}; outputs identical: "
              f"{r['scaling_outputs_identical']})",
              "goals: vs in-process >= 0.95, added latency p99 < 5 ms",
              f"gateway POST /v1/jobs: {gw['requests_per_s']:.0f} req/s "
              f"({gw['requests']} requests, {gw['concurrency']} concurrent, ack-only consumer)"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
