"""Service benchmark: Ferry in-process vs. Ferry through Redis (Python client, worker
subprocesses running ``worker.main.run_worker`` like ``ferry worker``), same model and
workload as ``ops/bench/engine.py``, one run.

Reports output tokens/s in-process and end to end (goal: ratio >= 0.95), the latency the
service adds per token (client receive time minus the engine loop's step-end time, taken
from a trace the bench's worker processes write; goal p99 < 5 ms), two single-threaded workers
against one (goal >= 1.8x: needs two free cores), and the gateway's enqueue rate with a
consumer that only acknowledges. Writes ``ops/bench/results/service.json``. Usage:

    .venv/bin/python ops/bench/service.py --quick    # 16 requests
    .venv/bin/python ops/bench/service.py            # 64 requests
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import torch  # noqa: E402

from ferry.commands.up import Stack, _free_port  # noqa: E402
from ops.bench.engine import run_ferry  # noqa: E402
from ops.bench.workload import Job, build_bench_model, main_workload  # noqa: E402
from protocol.aclient import AsyncFerryClient  # noqa: E402
from protocol.keys import Keys  # noqa: E402
from protocol.models import GenerateRequest  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from protocol.store import ensure_group  # noqa: E402

ENGINE_KW = dict(max_num_seqs=64, max_num_batched_tokens=1024, num_blocks=3300)
FERRY = [sys.executable, "-m", "ferry.cli"]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _requests(jobs: list[Job], tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=j.prompt, params=
                            SamplingParams(temperature=0, max_tokens=j.max_tokens,
                                           ignore_eos=True)) for i, j in enumerate(jobs)]


async def _stream(url: str, prefix: str, requests: list[GenerateRequest]) -> dict[str, Any]:
    """Open every subscription, then enqueue all at once and time until the last token."""
    client = AsyncFerryClient.from_url(url, prefix=prefix)
    subs = [client.subscribe(r.request_id) for r in requests]
    for sub in subs:
        await sub.open()
    arrivals: dict[tuple[str, int], float] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}

    async def follow(sub: Any, rid: str) -> None:
        while not sub.finished:
            for event in await sub.next_events(5.0):
                arrivals[(rid, event.seq)] = time.time()
                tokens[rid] += event.token_ids

    start = time.perf_counter()
    for r in requests:
        await client.enqueue(r)
    await asyncio.gather(*(follow(s, r.request_id) for s, r in zip(subs, requests, strict=True)))
    elapsed = time.perf_counter() - start
    for sub in subs:
        await sub.close()
    await client.aclose()
    return {"elapsed": elapsed, "arrivals": arrivals, "tokens": tokens}


def run_service(path: str, jobs: list[Job], workers: int, tmp: Path, compile_attn: bool,
                ) -> dict[str, Any]:
    """``workers`` worker processes on a fresh Redis: throughput and latency."""
    stack = Stack(tmp)
    prefix = f"bench{workers}"
    env = dict(os.environ, FERRY_TORCH_THREADS="1", FERRY_DEVICE="cpu", FERRY_PREFIX=prefix,
               FERRY_KV_CACHE_BLOCKS=str(ENGINE_KW["num_blocks"]),
               FERRY_MAX_NUM_SEQS=str(ENGINE_KW["max_num_seqs"]),
               FERRY_MAX_NUM_BATCHED_TOKENS=str(ENGINE_KW["max_num_batched_tokens"]))
    traces = [tmp / f"trace-{workers}-{i}.txt" for i in range(workers)]
    try:
        url = stack.start_redis()
        for i, trace in enumerate(traces):
            trace.unlink(missing_ok=True)
            stack.spawn(f"worker-{i}", [sys.executable, __file__, "--worker", path, url,
                                        f"bench-{i}", str(trace), str(int(compile_attn))], env)
        r = redis.Redis.from_url(url)
        while r.scard(f"{prefix}:workers") < workers:
            stack.check_alive()
            time.sleep(0.2)
        warm = [Job(j.prompt[:64], 8) for j in jobs[: 4 * workers]]
        asyncio.run(_stream(url, prefix, _requests(warm, "warm")))
        result = asyncio.run(_stream(url, prefix, _requests(jobs, "req")))
    finally:
        stack.stop()
    emitted = {}
    for trace in traces:
        for line in trace.read_text().splitlines():
            rid, seq, t_emit, t_sent = line.split()
            emitted[(rid, int(seq))] = (float(t_emit), float(t_sent))
    added = [(t - emitted[k][0]) * 1000 for k, t in result["arrivals"].items() if k in emitted]
    outbox = [(s - e) * 1000 for e, s in emitted.values()]
    return {**result, "added_ms": added, "outbox_ms": outbox}


def worker_mode(path: str, url: str, worker_id: str, trace: str, compile_attn: str) -> int:
    """A ``ferry worker`` (same ``run_worker``, settings from the same FERRY_* variables)
    that also writes ``request_id seq emitted_at sent_at`` per event it sends."""
    from worker.main import engine_config, run_worker
    from worker.redis_io import WorkerSettings

    out = open(trace, "w", buffering=1 << 20)  # noqa: SIM115 - closed below

    def observe(batch: list[Any], sent_at: float) -> None:
        out.write("".join(f"{o.request_id} {o.seq} {o.emitted_at:.6f} {sent_at:.6f}\n"
                          for o in batch))

    settings = WorkerSettings(redis_url=url, prefix=os.environ["FERRY_PREFIX"],
                              worker_id=worker_id)
    try:
        config = engine_config(path, compile_attention=compile_attn == "1")
        return run_worker(config, settings, torch_threads=1,
                          log_level="warning", observer=observe)
    finally:
        out.close()


def enqueue_rate(n: int, concurrency: int, tmp: Path) -> dict[str, float]:
    """POST /v1/jobs against ``ferry gateway`` while a consumer only XACKs."""
    import httpx

    stack = Stack(tmp)
    try:
        url, port = stack.start_redis(), _free_port()
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
                reply: Any = r.xreadgroup("ferry-workers", "acker", {"ferry:requests": ">"},
                                          512, 100)
                for stream in reply or []:
                    ids = [entry[0] for entry in stream[1]]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--compile-attention", action="store_true", help="CPU torch.compile path")
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/service.json"))
    ap.add_argument("--worker", nargs=5, metavar=("MODEL", "URL", "ID", "TRACE", "COMPILE"),
                    help=argparse.SUPPRESS)  # internal: the worker processes of this bench
    args = ap.parse_args()
    if args.worker:
        sys.exit(worker_mode(*args.worker))
    torch.set_num_threads(1)  # the same budget as each worker process
    path = build_bench_model()
    jobs = main_workload(16 if args.quick else 64)
    useful = sum(j.max_tokens for j in jobs)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferry-bench-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    kw = dict(ENGINE_KW, compile_attention=args.compile_attention)
    run_ferry(path, jobs[:4], **kw)  # warm-up
    start = time.perf_counter()
    ref = run_ferry(path, jobs, **kw)
    inproc_s = time.perf_counter() - start
    print(f"in-process: {inproc_s:.2f}s {useful / inproc_s:.1f} tok/s", flush=True)
    one = run_service(path, jobs, 1, tmp, args.compile_attention)
    print(f"1 worker:   {one['elapsed']:.2f}s {useful / one['elapsed']:.1f} tok/s", flush=True)
    two = run_service(path, jobs, 2, tmp, args.compile_attention)
    print(f"2 workers:  {two['elapsed']:.2f}s {useful / two['elapsed']:.1f} tok/s", flush=True)
    rate = enqueue_rate(300 if args.quick else 2000, 32, tmp)
    same = sum(one["tokens"][f"req-{i}"] == ref[i] for i in range(len(jobs)))
    result = {
        "requests": len(jobs), "output_tokens": useful, "torch_threads_per_engine": 1,
        "compile_attention": args.compile_attention, "cpus": os.cpu_count(),
        "in_process_tok_s": round(useful / inproc_s, 1),
        "one_worker_tok_s": round(useful / one["elapsed"], 1),
        "two_workers_tok_s": round(useful / two["elapsed"], 1),
        "ratio_e2e_vs_in_process": round(inproc_s / one["elapsed"], 3),
        "ratio_two_vs_one_worker": round(one["elapsed"] / two["elapsed"], 3),
        "added_latency_ms": {"p50": round(_pct(one["added_ms"], 0.5), 2),
                             "p99": round(_pct(one["added_ms"], 0.99), 2),
                             "events": len(one["added_ms"])},
        "outbox_lag_ms": {"p50": round(_pct(one["outbox_ms"], 0.5), 2),
                          "p99": round(_pct(one["outbox_ms"], 0.99), 2)},
        "identical_outputs_vs_in_process": same, "gateway_enqueue": rate,
    }
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def table(r: dict[str, Any]) -> str:
    lat, box, gw = r["added_latency_ms"], r["outbox_lag_ms"], r["gateway_enqueue"]
    rows = [
        ("in-process engine (1 thread)", f"{r['in_process_tok_s']:.1f} tok/s", ""),
        ("1 worker via Redis", f"{r['one_worker_tok_s']:.1f} tok/s",
         f"{r['ratio_e2e_vs_in_process']:.3f}x in-process (goal >= 0.95)"),
        ("2 workers via Redis", f"{r['two_workers_tok_s']:.1f} tok/s",
         f"{r['ratio_two_vs_one_worker']:.2f}x 1 worker (goal >= 1.8, {r['cpus']} cpus)"),
        ("added latency per token", f"p50 {lat['p50']:.2f} ms", f"p99 {lat['p99']:.2f} ms "
         "(goal < 5)"),
        ("  of which step -> Redis reply", f"p50 {box['p50']:.2f} ms", f"p99 {box['p99']:.2f} ms"),
        ("gateway POST /v1/jobs", f"{gw['requests_per_s']:.0f} req/s",
         f"{gw['requests']} requests, {gw['concurrency']} concurrent"),
        ("identical outputs", f"{r['identical_outputs_vs_in_process']}/{r['requests']}", ""),
    ]
    return "\n".join(f"{a:<32} {b:>18}   {c}" for a, b, c in rows)


if __name__ == "__main__":
    main()
