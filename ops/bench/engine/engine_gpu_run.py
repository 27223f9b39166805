"""The GPU suite's run: rows side by side in one process, a table, a results file.

Called by ``ops/bench/engine/engine.py --device cuda --model-size 1b|8b`` (see ``engine_gpu.py``
for models, workloads and the decode-step profile).
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ops.bench.engine import baselines
from ops.bench.engine.engine_gpu import (
    SIZES,
    WORKLOADS,
    build_model,
    gpu_name,
    hf_continuous_config,
    profile_decode_step,
)
from ops.bench.engine.workload import Job, run_jobs

ROOT = Path(__file__).resolve().parents[3]


def ferry_engine(path: str, device: str, jobs: list[Job], **kw: Any) -> Any:
    from worker import Engine, EngineConfig

    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    return Engine(EngineConfig.create(
        path, device=device, max_num_seqs=kw.pop("max_num_seqs", 256),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 8192),
        long_prefill_token_threshold=kw.pop("long_prefill_token_threshold", 2048),
        max_model_len=max(longest, 64), **kw,
    ))


def timed(name: str, fn: Callable[[], list[list[int]]], jobs: list[Job],
          sync: Callable[[], None]) -> dict[str, Any]:
    sync()
    start = time.perf_counter()
    outs = fn()
    sync()
    elapsed = time.perf_counter() - start
    useful = sum(j.max_tokens for j in jobs)
    total = useful + sum(len(j.prompt) for j in jobs)
    row = {"system": name, "requests": len(jobs), "seconds": round(elapsed, 3),
           "output_tok_s": round(useful / elapsed, 1), "total_tok_s": round(total / elapsed, 1),
           "req_s": round(len(jobs) / elapsed, 2),
           "complete": [len(o) for o in outs] == [j.max_tokens for j in jobs]}
    print(f"  {name:<36} {elapsed:9.2f}s {row['output_tok_s']:10.1f} out tok/s "
          f"{row['req_s']:8.2f} req/s", flush=True)
    return row


def main(args: Any) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.model_size or ("1b" if device.startswith("cuda") else "tiny")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    path = build_model(size, device)
    jobs = WORKLOADS[args.workload](SIZES[size].vocab, args.scale)
    result: dict[str, Any] = {
        "machine": {"device": gpu_name(device), "cpu": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "model_size": size, "workload": args.workload, "requests": len(jobs),
        "prompt_tokens": sum(len(j.prompt) for j in jobs),
        "output_tokens": sum(j.max_tokens for j in jobs),
    }
    rows = [ferry_row(path, device, jobs, sync, result, args.profile, size)]
    if device.startswith("cuda") and "variants" not in args.skip:
        # what each GPU lever is worth, in the same run
        rows.append(ferry_row(path, device, jobs, sync, result, False, size,
                              "ferry, steps not overlapped", async_scheduling=False))
        rows.append(ferry_row(path, device, jobs, sync, result, False, size,
                              "ferry, eager (no CUDA graphs)", enforce_eager=True))
    if "hf" not in args.skip:
        rows += hf_rows(path, device, jobs, sync)
    base = rows[0]["output_tok_s"]
    print(f"\n{'system':<36} {'seconds':>9} {'out tok/s':>10} {'req/s':>8} {'vs ferry':>9}")
    for row in rows:
        print(f"{row['system']:<36} {row['seconds']:>9.2f} {row['output_tok_s']:>10.1f} "
              f"{row['req_s']:>8.2f} {row['output_tok_s'] / base:>8.2f}x")
    result["rows"] = rows
    out = Path(args.out or ROOT / f"ops/bench/results/engine-{gpu_name(device)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(out.read_text()) if out.exists() else {}
    previous[f"{size}/{args.workload}"] = result
    out.write_text(json.dumps(previous, indent=2))
    print(f"wrote {out}")


def ferry_row(path: str, device: str, jobs: list[Job], sync: Callable[[], None],
              result: dict[str, Any], profile: bool, size: str, name: str = "ferry",
              **engine_kw: Any) -> dict[str, Any]:
    """Ferry's row (and, with ``profile``, the decode-step profile); the engine and its KV
    cache are freed on return, before the next row loads the model again."""
    engine = ferry_engine(path, device, jobs, **engine_kw)
    if profile:
        result["decode_step"] = profile_decode_step(engine, batch=min(256, len(jobs)),
                                                    context=800 if size != "tiny" else 64)
        print(f"decode step: {result['decode_step']}", flush=True)
    run_jobs(engine, jobs[:4])  # warm-up: compilation and first-call costs out of timing
    row = timed(name, lambda: run_jobs(engine, jobs), jobs, sync)
    engine = None  # the KV pool (90% of free memory) goes before the next row's
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def hf_rows(path: str, device: str, jobs: list[Job], sync: Callable[[], None]) -> list[dict]:
    """transformers' continuous batching, static batches of 64, sequential on 4 requests."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = baselines.load_hf(path, device=device, dtype=dtype)
    cb = hf_continuous_config(page=256, max_batch_tokens=8192, max_requests_per_batch=256,
                              allow_block_sharing=False)
    rows = [
        timed("hf continuous batching", lambda: baselines.hf_continuous(model, jobs, cb_cfg=cb),
              jobs, sync),
        timed("hf static batches of 64", lambda: baselines.static_batches(model, jobs, 64),
              jobs, sync),
    ]
    few = jobs[:4]
    rows.append(timed("hf sequential generate (4 requests)",
                      lambda: baselines.sequential(model, few), few, sync))
    return rows
