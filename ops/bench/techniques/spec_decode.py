"""Speculative decoding (suffix decoding) on vs off, the same engine settings otherwise.

On the default model (``worker.models.default_model_path()``, a small Llama trained on the
Python stdlib), CPU, greedy, every request exactly ``max_tokens`` long (64; 32 with
``--quick``), one torch thread (``--threads``), the engine's speculative defaults:

* ``repeat``: N code prompts (64; 16 with ``--quick``; spans of the held-out stdlib files)
  answered once (``1st pass``: drafts from each request's own text and the store as it
  fills), the same N sent again on the same engine as retries (``retries``: the store holds
  the first answers), and N "continue" requests whose output repeats a span of the prompt
  (``continue``: a code prompt plus the model's own first 64 tokens of answer; this model's
  greedy answers loop, so the continuation repeats the prompt's spans); ``repeat bB (all)``
  sums the three. At batch 1 (``max_num_seqs`` 1) and batch 16 (``max_num_seqs`` 16, all
  submitted at t=0, a finished row's slot taken by the next request), where the adaptive
  back-off decides per row what is worth drafting.
* ``mixed``: the engine benchmark's main workload (``workload.main_workload``: N prompts of
  32-512 tokens, outputs 16-256, all at t=0, ``max_num_seqs`` 64): nothing repeats across
  requests, so speculation must cost nothing there.

Off and on alternate (ABAB) for ``--rounds`` rounds on fresh engines; the ratios are of
the summed times: wall-clock and CPU time (``time.process_time``; the machine is shared,
CPU time is what its load disturbs least). Outputs are compared on/off request by request,
every round. Prints a table, writes ``ops/bench/results/spec_decode.json``.

With ``--threads 2`` (a worker's default on the 2-core dev machine: torch's thread count)
CPU time also counts the second thread's work and its spin-waits, so there the wall-clock
ratio is the measure; steps of at most ~19 tokens run on one thread by design
(``step_threads.py``), so a plain batch-16 decode step is serial where a verification step
of 30-500 tokens uses both cores.

    python ops/bench/techniques/spec_decode.py [--quick] [--rounds N] [--threads T] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.engine.workload import Job, main_workload  # noqa: E402

ENGINE_KW = dict(max_num_batched_tokens=1024, long_prefill_token_threshold=512,
                 num_blocks=3300, device="cpu")
# the defaults otherwise: up to 16 draft tokens, the adaptive back-off
SPEC_KW: dict[str, object] = dict(speculative="suffix")
MIXED_SEQS = 64


def code_snippets(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` token spans of ``lo``..``hi`` tokens from the held-out stdlib files (the
    default model's domain, text it was not trained on), seeded."""
    from transformers import AutoTokenizer

    from ops.train.data import is_heldout, list_sources, stdlib_root
    from worker.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    root = stdlib_root()
    files = [rel for i, rel in enumerate(list_sources(root)) if is_heldout(i)]
    texts = [tok.encode((root / rel).read_text(encoding="utf-8"), add_special_tokens=False,
                        verbose=False) for rel in files]
    texts = [t for t in texts if len(t) > hi]
    rng = random.Random(seed)
    spans = []
    for _ in range(n):
        ids, size = rng.choice(texts), rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - size)
        spans.append(ids[start:start + size])
    return spans


def repeat_jobs(n: int, out: int) -> list[Job]:
    return [Job(p, out) for p in code_snippets(n, 48, 128, seed=3)]


def continuation_jobs(path: str, n: int, out: int, answered: int = 64) -> list[Job]:
    """"Continue" requests: a code prompt plus the model's own first ``answered`` tokens
    of answer; this model's greedy answers loop, so the continuation repeats spans of the
    prompt (the request's own index drafts them)."""
    prompts = code_snippets(n, 32, 64, seed=5)
    first = run_setting(path, {"answers": ([Job(p, answered) for p in prompts], 64)}, {})
    return [Job(p + o, out) for p, o in zip(prompts, first["answers"]["outs"], strict=True)]


def run_pass(engine: Any, jobs: list[Job], tag: str) -> dict[str, Any]:
    """Every job through ``engine`` (submitted at once): times, outputs, spec counters."""
    from protocol.sampling import SamplingParams
    from worker.engine.output.text_output import TextOutputs

    outs: dict[str, list[int]] = {}
    before, steps = engine.stats(), engine.steps
    wall, cpu = time.perf_counter(), time.process_time()
    for i, job in enumerate(jobs):  # all at t=0; the engine runs max_num_seqs at a time
        outs[f"{tag}{i}"] = []
        engine.add_request(f"{tag}{i}", job.prompt, SamplingParams(
            temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs[out.request_id] += out.new_token_ids
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = engine.stats()
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(j.max_tokens for j in jobs),
            "steps": engine.steps - steps,
            "drafted": after.spec_drafted_tokens - before.spec_drafted_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens,
            "draft_rows": after.spec_draft_rows - before.spec_draft_rows,
            "outs": [outs[f"{tag}{i}"] for i in range(len(jobs))]}


def run_setting(path: str, workloads: dict[str, tuple[list[Job], int]],
                spec: dict[str, object]) -> dict[str, dict[str, Any]]:
    """Each workload (jobs, max_num_seqs) once; the passes of one family and batch
    share an engine (the retries need the first answers in its store)."""
    from worker import Engine, EngineConfig

    got: dict[str, dict[str, Any]] = {}
    engines: dict[str, Any] = {}
    for k, (name, (jobs, seqs)) in enumerate(workloads.items()):
        family = name.split(",")[0]
        if family not in engines:
            engines[family] = Engine(EngineConfig.create(path, max_num_seqs=seqs,
                                                         **ENGINE_KW, **spec))
        got[name] = run_pass(engines[family], jobs, f"w{k}-")
    engines.clear()
    gc.collect()  # engines hold reference cycles: free their KV pools before the next
    return got


def build_workloads(path: str, n: int, out: int) -> dict[str, tuple[list[Job], int]]:
    repeat, spans = repeat_jobs(n, out), continuation_jobs(path, n, out)
    workloads: dict[str, tuple[list[Job], int]] = {}
    for batch in (1, 16):
        for part, jobs in (("1st pass", repeat), ("retries", repeat), ("continue", spans)):
            workloads[f"repeat b{batch}, {part}"] = (jobs, batch)
    workloads["mixed"] = (main_workload(n), MIXED_SEQS)
    return workloads


def summarize(name: str, off: list[dict[str, Any]], on: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """Ratios of summed tokens/time over the rounds; outputs compared every round."""
    def total(runs: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] for r in runs)

    tokens = total(off, "tokens")
    same = sum(x == y for a, b in zip(off, on, strict=True)
               for x, y in zip(a["outs"], b["outs"], strict=True))
    drafted, accepted, rows = (total(on, k) for k in ("drafted", "accepted", "draft_rows"))
    row = {"workload": name, "rounds": len(off),
           "off_wall_tok_s": tokens / total(off, "wall_s"),
           "on_wall_tok_s": tokens / total(on, "wall_s"),
           "off_cpu_tok_s": tokens / total(off, "cpu_s"),
           "on_cpu_tok_s": tokens / total(on, "cpu_s"),
           "cpu_x_per_round": [round(a["cpu_s"] / b["cpu_s"], 3)
                               for a, b in zip(off, on, strict=True)],
           "wall_x_per_round": [round(a["wall_s"] / b["wall_s"], 3)
                                for a, b in zip(off, on, strict=True)],
           "steps_off": off[0]["steps"], "steps_on": on[0]["steps"],
           "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
           "mean_acceptance_length": round((accepted + rows) / rows, 2) if rows else 0.0,
           "drafted_tokens": drafted,
           "identical_outputs": f"{same}/{sum(len(r['outs']) for r in off)}"}
    row["wall_x"] = round(row["on_wall_tok_s"] / row["off_wall_tok_s"], 3)
    row["cpu_x"] = round(row["on_cpu_tok_s"] / row["off_cpu_tok_s"], 3)
    for key in ("off_wall_tok_s", "on_wall_tok_s", "off_cpu_tok_s", "on_cpu_tok_s"):
        row[key] = round(row[key], 1)
    return row


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The passes of one family as one run (their outputs in order)."""
    out = {k: sum(r[k] for r in runs) for k in runs[0] if k != "outs"}
    out["steps"] = sum(r["steps"] for r in runs)
    out["outs"] = [o for r in runs for o in r["outs"]]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<24} {'off tok/s':>9} {'on tok/s':>9} {'wall x':>7} "
            f"{'cpu off':>8} {'cpu on':>8} {'cpu x':>6} {'steps':>11} {'accept':>7} "
            f"{'len':>5} {'same':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['workload']:<24} {r['off_wall_tok_s']:>9.1f} "
                     f"{r['on_wall_tok_s']:>9.1f} {r['wall_x']:>6.2f}x "
                     f"{r['off_cpu_tok_s']:>8.1f} {r['on_cpu_tok_s']:>8.1f} "
                     f"{r['cpu_x']:>5.2f}x {r['steps_off']:>5}/{r['steps_on']:<5} "
                     f"{r['acceptance_rate']:>7.0%} {r['mean_acceptance_length']:>5.2f} "
                     f"{r['identical_outputs']:>7}")
    return "\n".join(lines)


def main() -> None:
    from worker.models import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16 requests per workload")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, ABAB")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/spec_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    n, out = (16, 32) if args.quick else (64, 64)
    workloads = build_workloads(path, n, out)
    run_setting(path, {"warm-up": (repeat_jobs(2, 8), 1)}, SPEC_KW)  # first-call costs
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for label, spec in (("off", {}), ("on", SPEC_KW)):
            runs[label].append(run_setting(path, workloads, spec))
            print(f"round {r + 1} {label}: " + ", ".join(
                f"{k} {v['wall_s']:.1f}s ({v['cpu_s']:.1f} CPU s)"
                for k, v in runs[label][-1].items()), flush=True)
    rows = [summarize(name, [g[name] for g in runs["off"]], [g[name] for g in runs["on"]])
            for name in workloads]
    for batch in (1, 16):
        parts = [k for k in workloads if k.startswith(f"repeat b{batch},")]
        rows.append(summarize(f"repeat b{batch} (all)",
                              *[[merged([g[k] for k in parts]) for g in runs[label]]
                                for label in ("off", "on")]))
    print("\n" + table(rows))
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "model": "default", "engine": ENGINE_KW, "speculative": SPEC_KW,
              "requests": n, "output_tokens": out, "quick": args.quick,
              "rounds": args.rounds, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
