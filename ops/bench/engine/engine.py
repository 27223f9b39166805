"""Engine benchmark: Ferry beside transformers' sequential, static and continuous batching.

Same model, same workload, same process, one run; prints a side-by-side table and writes
``ops/bench/results/engine.json``. Usage:

    .venv/bin/python ops/bench/engine/engine.py            # full run (several minutes on 2 cores)
    .venv/bin/python ops/bench/engine/engine.py --quick    # 16 requests, smoke-sized
    python ops/bench/engine/engine.py --device cuda --model-size 1b [--workload W] [--profile]

With ``--device``/``--model-size`` it runs the GPU suite instead (``engine_gpu.py``: Llama
shapes of 1B/8B parameters, workloads ``mixed-gpu`` and ``throughput-256``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.engine import baselines  # noqa: E402
from ops.bench.engine.workload import (  # noqa: E402
    Job,
    build_bench_model,
    classic_workload,
    main_workload,
    run_jobs,
)


def run_ferry(path: str, jobs: list[Job], profile: dict[str, float] | None = None,
              **engine_kw: Any) -> list[list[int]]:
    from worker import Engine, EngineConfig

    engine = Engine(EngineConfig.create(path, device="cpu", **engine_kw))
    attn_time = _time_attention(engine) if profile is not None else None
    outs = run_jobs(engine, jobs)
    if profile is not None:
        profile.update(engine.phase_s)
        profile["attention"] = attn_time[0] if attn_time else 0.0
        profile["steps"] = engine.stats().steps
    return outs


def _time_attention(engine: Any) -> list[float]:
    """Wrap the attention backend to accumulate its wall time (profiling only)."""
    total = [0.0]
    backend = engine.runner.backend
    inner = backend.forward

    def timed(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            total[0] += time.perf_counter() - start

    backend.forward = timed
    return total


def measure(name: str, fn: Callable[[], list[list[int]]], jobs: list[Job]) -> dict[str, Any]:
    start = time.perf_counter()
    outs = fn()
    elapsed = time.perf_counter() - start
    useful = sum(j.max_tokens for j in jobs)
    assert [len(o) for o in outs] == [j.max_tokens for j in jobs], f"{name}: wrong lengths"
    row = {"system": name, "seconds": round(elapsed, 2), "output_tokens": useful,
           "output_tok_s": round(useful / elapsed, 1)}
    print(f"  {name:<34} {elapsed:8.2f}s {useful / elapsed:9.1f} tok/s", flush=True)
    return {**row, "_outs": outs}


def table(rows: list[dict[str, Any]], base: str) -> str:
    ref = next(r["output_tok_s"] for r in rows if r["system"] == base)
    lines = [f"{'system':<34} {'seconds':>8} {'out tok/s':>10} {'vs ' + base:>16}"]
    for r in rows:
        lines.append(f"{r['system']:<34} {r['seconds']:>8.2f} {r['output_tok_s']:>10.1f} "
                     f"{r['output_tok_s'] / ref:>15.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--skip", nargs="*", default=[], help="systems to skip")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default=None, help="cuda: the GPU suite (engine_gpu.py)")
    ap.add_argument("--model-size", default=None, choices=["tiny", "1b", "8b"])
    ap.add_argument("--workload", default="mixed-gpu", choices=["mixed-gpu", "throughput-256"])
    ap.add_argument("--scale", type=float, default=1.0, help="GPU suite: fraction of requests")
    ap.add_argument("--profile", action="store_true", help="GPU suite: one decode step")
    args = ap.parse_args()
    if args.device is not None or args.model_size is not None:
        from ops.bench.engine.engine_gpu_run import main as gpu_main

        gpu_main(args)
        return
    args.out = args.out or str(ROOT / "ops/bench/results/engine.json")
    path = build_bench_model()
    jobs = main_workload(16 if args.quick else 64)
    hf = baselines.load_hf(path)
    ferry_kw = dict(max_num_seqs=64, max_num_batched_tokens=1024, num_blocks=3300,
                    long_prefill_token_threshold=512)
    run_ferry(path, jobs[:4], **ferry_kw)  # warm-up: first-call costs out of the timing
    baselines.sequential(hf, [Job(jobs[0].prompt, 4)])
    profile: dict[str, float] = {}
    systems: list[tuple[str, Callable[[], list[list[int]]]]] = [
        ("ferry", lambda: run_ferry(path, jobs, profile, **ferry_kw)),
        ("ferry (bf16 KV cache)",
         lambda: run_ferry(path, jobs, **{**ferry_kw, "kv_cache_dtype": "bfloat16"})),
        ("ferry (torch attention backend)",
         lambda: run_ferry(path, jobs, **{**ferry_kw, "attention_backend": "torch"})),
        ("ferry (nn.Linear, no packing)",
         lambda: run_ferry(path, jobs, **{**ferry_kw, "pack_weights": False})),
        ("hf generate_batch (512 tok, page 64)", lambda: baselines.hf_continuous(hf, jobs)),
        ("hf generate_batch (256 tok, page 32)",
         lambda: baselines.hf_continuous(hf, jobs, max_batch_tokens=256, page_size=32)),
        ("hf static batches of 8", lambda: baselines.static_batches(hf, jobs)),
        ("hf sequential generate", lambda: baselines.sequential(hf, jobs)),
    ]
    print(f"main workload: {len(jobs)} requests, {sum(len(j.prompt) for j in jobs)} prompt "
          f"tokens, {sum(j.max_tokens for j in jobs)} output tokens", flush=True)
    rows = [measure(n, f, jobs) for n, f in systems if n.split()[0] not in args.skip
            and n not in args.skip]
    base = "hf sequential generate" if any(r["system"] == "hf sequential generate"
                                           for r in rows) else rows[-1]["system"]
    ref_outs = rows[-1]["_outs"]  # the last system run (sequential, unless skipped)
    agree = {r["system"]: sum(a == b for a, b in zip(r["_outs"], ref_outs, strict=True))
             for r in rows[:-1]}

    classic = classic_workload()
    print("classic 8-request example:", flush=True)
    crows = [
        measure("no batching (sequential)", lambda: baselines.sequential(hf, classic), classic),
        measure("static batching (1 batch of 8)",
                lambda: baselines.static_batches(hf, classic), classic),
        measure("continuous batching (ferry)", lambda: run_ferry(path, classic, **ferry_kw),
                classic),
    ]
    print("\n" + table(rows, base) + "\n")
    print(table(crows, "no batching (sequential)") + "\n")
    steps = profile.pop("steps", 0)
    total = sum(v for k, v in profile.items() if k != "attention")
    print(f"ferry step profile over {steps:.0f} steps ({total:.2f}s): " + ", ".join(
        f"{k} {v:.2f}s ({100 * v / total:.0f}%)" for k, v in profile.items()))
    print(f"requests with outputs identical to {rows[-1]['system']} (of {len(jobs)}): {agree}")
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "main": [{k: v for k, v in r.items() if k != "_outs"} for r in rows],
        "classic": [{k: v for k, v in r.items() if k != "_outs"} for r in crows],
        "ferry_profile_s": profile, "ferry_steps": steps, "identical_outputs": agree,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
