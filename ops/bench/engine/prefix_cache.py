"""Prefix-cache benchmark: the same engine with automatic prefix caching on and off.

Workloads (seeded, the 30M bench model of ``workload.py``, greedy, every request exactly
``max_tokens``), all requests submitted at t=0:

* ``shared``: 64 requests sharing a 1,500-token prefix, distinct 32-token tails, 64 output
  tokens each — a batch job with long common instructions;
* ``mixed``: the engine benchmark's main workload (nothing shared: the cache must cost
  nothing there), five alternating rounds, median ratio;
* ``shared, small pool``: 24 of the shared requests on a pool that forces preemption.

Rows: throughput, TTFT p50/p99, prefix-cache hit rate; outputs compared on/off request by
request. Prints a table, writes ``ops/bench/results/prefix_cache.json``.

    .venv/bin/python ops/bench/engine/prefix_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.engine.workload import VOCAB, Job, build_bench_model, main_workload  # noqa: E402

ENGINE_KW = dict(max_num_seqs=64, max_num_batched_tokens=1024, long_prefill_token_threshold=512)


def shared_workload(n: int = 64, prefix: int = 1500, tail: int = 32, out: int = 64) -> list[Job]:
    rng = random.Random(11)
    common = [rng.randrange(2, VOCAB) for _ in range(prefix)]
    return [Job(common + [rng.randrange(2, VOCAB) for _ in range(tail)], out) for _ in range(n)]


def run(path: str, jobs: list[Job], caching: bool, num_blocks: int) -> dict[str, Any]:
    """One engine, every job at t=0; wall time, per-request TTFT, outputs, cache stats."""
    from protocol.sampling import SamplingParams
    from worker import Engine, EngineConfig

    engine = Engine(EngineConfig.create(path, device="cpu", num_blocks=num_blocks,
                                        enable_prefix_caching=caching, **ENGINE_KW))
    start = time.perf_counter()
    for i, job in enumerate(jobs):
        engine.add_request(str(i), job.prompt, SamplingParams(
            temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    outs: list[list[int]] = [[] for _ in jobs]
    ttft: list[float] = [0.0] * len(jobs)
    from worker.engine.output.text_output import TextOutputs

    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            i = int(out.request_id)
            if not outs[i]:
                ttft[i] = time.perf_counter() - start
            outs[i] += out.new_token_ids
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    assert [len(o) for o in outs] == [j.max_tokens for j in jobs]
    assert stats.kv_blocks_free == num_blocks  # nothing held: free or cached-evictable
    useful = sum(j.max_tokens for j in jobs)
    return {
        "seconds": round(elapsed, 2), "output_tok_s": round(useful / elapsed, 1),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_p99_s": round(sorted(ttft)[int(0.99 * (len(ttft) - 1))], 3),
        "hit_rate": round(stats.prefix_cache_hit_rate, 4),
        "preemptions": stats.num_preemptions, "_outs": outs,
    }


def compare(name: str, path: str, jobs: list[Job], num_blocks: int,
            rounds: int = 1) -> dict[str, Any]:
    """Cache off then on, ``rounds`` times alternating; the median round's ratio (a
    2-core machine's noise is several percent per run)."""
    ratios = []
    for _ in range(rounds):
        off = run(path, jobs, False, num_blocks)
        on = run(path, jobs, True, num_blocks)
        ratios.append(on["output_tok_s"] / off["output_tok_s"])
    same = sum(a == b for a, b in zip(on.pop("_outs"), off.pop("_outs"), strict=True))
    row = {"workload": name, "requests": len(jobs), "num_blocks": num_blocks,
           "prompt_tokens": sum(len(j.prompt) for j in jobs), "cache_off": off, "cache_on": on,
           "throughput_x": round(statistics.median(ratios), 3),
           "round_ratios": [round(r, 3) for r in ratios],
           "ttft_p50_ratio": round(on["ttft_p50_s"] / off["ttft_p50_s"], 3),
           "identical_outputs": f"{same}/{len(jobs)}"}
    print(f"  {name:<22} off {off['seconds']:7.2f}s  on {on['seconds']:7.2f}s  "
          f"x{row['throughput_x']:.2f}  ttft p50 {off['ttft_p50_s']:.2f}s -> "
          f"{on['ttft_p50_s']:.2f}s  hits {on['hit_rate']:.0%}  same {same}/{len(jobs)}",
          flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<22} {'off tok/s':>9} {'on tok/s':>9} {'x':>6} {'ttft p50 off':>12} "
            f"{'on':>7} {'ratio':>6} {'hits':>5} {'preempt':>7} {'same':>7}")
    lines = [head]
    for r in rows:
        off, on = r["cache_off"], r["cache_on"]
        lines.append(
            f"{r['workload']:<22} {off['output_tok_s']:>9.1f} {on['output_tok_s']:>9.1f} "
            f"{r['throughput_x']:>5.2f}x {off['ttft_p50_s']:>11.2f}s {on['ttft_p50_s']:>6.2f}s "
            f"{r['ttft_p50_ratio']:>6.3f} {on['hit_rate']:>5.0%} "
            f"{off['preemptions']:>3}/{on['preemptions']:<3} {r['identical_outputs']:>7}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/prefix_cache.json"))
    args = ap.parse_args()
    path = build_bench_model()
    n = 16 if args.quick else 64
    shared, mixed = shared_workload(n), main_workload(n)
    run(path, shared[:2], True, 400)  # warm-up: first-call costs out of the timing
    print(f"prefix cache on vs off, {torch.get_num_threads()} threads", flush=True)
    rows = [
        compare("shared 1500-token prefix", path, shared, 8000),
        compare("mixed (nothing shared)", path, mixed, 8000, rounds=5),
        compare("shared, small pool", path, shared[: max(8, n * 3 // 8)], 230),
    ]
    print("\n" + table(rows))
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "engine": ENGINE_KW, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
