"""A/B of the CPU engine between two checkouts: the ``ferry`` row of ``engine.py``, alternating.

On a shared machine a single run of ``engine.py`` is noise (the same system measured
100-490 tok/s from one run to the next under a load of 4-5 on 2 cores). This runs the
same measure, the main workload through ``run_ferry`` after its warm-up, in a fresh
process per trial, alternating the two checkouts, and reports medians of wall time and of
the process's CPU time: with one torch thread the CPU time counts the work done, and
contention for the cores inflates it far less than the wall time.

    .venv/bin/python ops/bench/engine/engine_ab.py --before /path/to/old/checkout [--rounds 5]

``--measure sampler`` times the sampler alone instead (the benchmark's workload is
greedy): 64 seeded rows over an 8,192-token vocabulary, plain, with top-k/top-p, with
penalties, with logprobs; CPU milliseconds per step, one thread.

Results go to ``ops/bench/results/engine-ab.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TRIAL = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from ops.bench.engine.engine import run_ferry
from ops.bench.engine.workload import build_bench_model, main_workload
path = build_bench_model()
jobs = main_workload({requests})
kw = dict(max_num_seqs=64, max_num_batched_tokens=1024, num_blocks=3300,
          long_prefill_token_threshold=512)
run_ferry(path, jobs[:4], **kw)
wall, cpu = time.perf_counter(), time.process_time()
outs = run_ferry(path, jobs, **kw)
print(json.dumps({{"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "tokens": sum(len(o) for o in outs)}}))
"""


SAMPLER_TRIAL = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from protocol.sampling import SamplingParams
from worker.engine.sample.sampler import Sampler, SamplingRow
extra = dict(plain={{}}, top_k_top_p=dict(top_k=50, top_p=0.9),
             penalties=dict(repetition_penalty=1.1, frequency_penalty=0.2),
             logprobs=dict(logprobs=5))
logits = torch.randn(64, 8192, generator=torch.Generator().manual_seed(0))
result = {{}}
for name, kw in extra.items():
    rows = [SamplingRow(SamplingParams(temperature=0.8, seed=1000 + i, **kw), 7,
                        list(range(200)), list(range(100))) for i in range(64)]
    sampler = Sampler(0)
    sampler(logits, rows)
    cpu = time.process_time()
    for _ in range(20):
        sampler(logits, rows)
    result[name + "_cpu_ms"] = (time.process_time() - cpu) / 20 * 1000
print(json.dumps(result))
"""


def trial(root: Path, requests: int, measure: str = "engine") -> dict[str, float]:
    template = TRIAL if measure == "engine" else SAMPLER_TRIAL
    code = template.format(root=str(root), requests=requests)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=root, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the other checkout (the baseline)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--measure", default="engine", choices=["engine", "sampler"])
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/engine-ab.json"))
    args = ap.parse_args()
    sides = {"before": Path(args.before).resolve(), "after": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, root in sides.items():
            runs[name].append(trial(root, args.requests, args.measure))
            print(f"round {r} {name:<6} " + "  ".join(
                f"{k} {v:8.2f}" for k, v in runs[name][-1].items()), flush=True)
    keys = [k for k in runs["after"][0] if k != "tokens"]
    med = {name: {k: statistics.median(t[k] for t in ts) for k in keys}
           for name, ts in runs.items()}
    ratio = {k: med["before"][k] / med["after"][k] for k in keys}
    for k in keys:
        print(f"median {k:<22} before {med['before'][k]:8.2f}  after {med['after'][k]:8.2f}"
              f"  (after is {ratio[k]:.3f}x as fast)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(
        {"before": str(sides["before"]), "rounds": runs, "median": med,
         "speed_ratio_after_over_before": ratio}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
