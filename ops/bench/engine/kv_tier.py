"""The KV cache's host tier on vs off, in one run, on the default model (CPU).

Workloads (seeded, greedy, every request exactly ``max_tokens``):

* ``preemption``: a batch file whose lines share a document: 16 lines (32 full) of a
  shared 256-token document plus 64 tokens of their own and 96 output tokens, submitted at
  t=0 to a device pool of a quarter of what they need together (the document counted once:
  the prefix cache shares it). The prompts fit, the decodes growing into the pool preempt
  running lines again and again; output tokens per second, and the tokens the forwards
  computed beyond each line's prompt and outputs (recomputed after preemption).
* ``preemption_long``: the shape where swapping is meant to pay, long contexts of
  their own (an agent's or a RAG request's context: nothing shared) with long outputs: 16
  lines (32 full) of 256 tokens each and 256 output tokens, pool a quarter of the demand.
  A preempted line's blocks are its own, so recompute re-prefills its whole context
  (prompt and the outputs so far) where the tier copies them back; in the shared-document
  shape the document stays cached on the device (the other lines hold it) and only a
  line's own 64 tokens and outputs are recomputed. Both are reported, neither replaces
  the other.
* ``multi-turn``: 6 conversations (16 full) of 4 turns, served round by round (every
  conversation's turn 1, then every turn 2, ...), each turn's prompt the conversation so far
  plus a new 48-token message; the conversations' KV is 4x the device pool, so a
  conversation is evicted from the device before it comes back. Each request runs alone
  (a user waiting on it): median time to first token (over every turn, and over turns 2..4
  alone: a turn 1 has nothing cached either way), and the prompt tokens computed (prompt
  tokens minus those taken from the cache, either tier).

Rows: tier off / on and their ratio; outputs compared request by request. Timings on a
shared 2-core machine are noisy, so each workload runs ``--repeats`` times per side in
ABBA order (off, on, on, off, ...), and the rows take the best of them: the fastest run's
tokens per second, each request's fastest time to first token (the work is identical every
time; a busy machine only adds). The same rows in this process's CPU time (``cpu``): with
``--threads 1`` that is the work itself, which other processes on the machine barely
change. The load average is recorded next to them. Prints a table, writes
``ops/bench/results/kv_tier.json``.

    .venv/bin/python ops/bench/engine/kv_tier.py [--quick] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
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

from worker.engine.output.text_output import TextOutputs  # noqa: E402

RESULTS = ROOT / "ops" / "bench" / "results" / "kv_tier.json"
BLOCK = 16
HOST_BYTES = 1 << 30
ENGINE_KW = dict(block_size=BLOCK, max_num_seqs=32, max_num_batched_tokens=1024,
                 long_prefill_token_threshold=512, device="cpu")


def _engine(path: str, num_blocks: int, tier: bool) -> Any:
    from worker import Engine, EngineConfig
    return Engine(EngineConfig.create(path, num_blocks=num_blocks,
                                      host_memory_bytes=HOST_BYTES if tier else 0,
                                      **ENGINE_KW))


def _params(max_tokens: int) -> Any:
    from protocol.sampling import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# the preemption workloads' shapes: (shared document, each line's own tokens, outputs)
SHARED_DOC = (256, 64, 96)
LONG_CONTEXT = (0, 256, 256)


def preemption(path: str, tier: bool, n: int, vocab: int,
               shape: tuple[int, int, int] = SHARED_DOC) -> dict[str, Any]:
    rng = random.Random(3)
    doc_len, line_len, out_len = shape
    document = [rng.randrange(3, vocab) for _ in range(doc_len)]
    jobs = [document + [rng.randrange(3, vocab) for _ in range(line_len)] for _ in range(n)]
    demand = doc_len // BLOCK + n * -(-(line_len + out_len) // BLOCK)
    engine = _engine(path, demand // 4, tier)
    computed = _count_computed(engine)
    start, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(jobs):
        engine.add_request(str(i), prompt, _params(out_len))
    outs: dict[str, list[int]] = {str(i): [] for i in range(n)}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs[out.request_id] += out.new_token_ids
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    # every token a line needs computed once: its prompt less the document's cached blocks
    # (computed by the first line), and its outputs but the last
    needed = doc_len + n * (line_len + out_len - 1)
    return {"tok_s": n * out_len / wall, "wall_s": wall, "outputs": outs,
            "tok_per_cpu_s": n * out_len / cpu, "cpu_s": cpu,
            "preemptions": engine.scheduler.num_preemptions, "steps": computed["steps"],
            "tokens_computed": computed["tokens"],
            "tokens_recomputed": computed["tokens"] - needed,
            "device_blocks": demand // 4, **_tier_stats(engine)}


def _count_computed(engine: Any) -> dict[str, int]:
    """Count the steps and the tokens their forwards compute (wraps ``schedule``)."""
    counts = {"steps": 0, "tokens": 0}
    schedule = engine.scheduler.schedule

    def counted() -> Any:
        out = schedule()
        counts["steps"] += 1
        counts["tokens"] += out.num_batched_tokens
        return out
    engine.scheduler.schedule = counted
    return counts


def multi_turn(path: str, tier: bool, conversations: int, turns: int,
               vocab: int) -> dict[str, Any]:
    rng = random.Random(5)
    messages = [[[rng.randrange(3, vocab) for _ in range(48)] for _ in range(turns)]
                for _ in range(conversations)]
    answer = 32
    # the conversations' full KV at their last turn, 4x the device pool
    final_len = turns * (48 + answer)
    working_set = conversations * -(-final_len // BLOCK)
    engine = _engine(path, max(working_set // 4, 2 * -(-final_len // BLOCK)), tier)
    history: list[list[int]] = [[] for _ in range(conversations)]
    ttfts: list[float] = []
    cpus: list[float] = []  # the same in this process's CPU time
    computed, outs = 0, {}
    for turn in range(turns):
        for c in range(conversations):
            prompt = history[c] + messages[c][turn]
            rid = f"c{c}t{turn}"
            hits_before = engine.block_manager.stats.hits
            start, cpu = time.perf_counter(), time.process_time()
            engine.add_request(rid, prompt, _params(answer))
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for out in TextOutputs.of(engine).step():
                    if not tokens and out.new_token_ids:
                        ttfts.append((time.perf_counter() - start) * 1000)
                        cpus.append((time.process_time() - cpu) * 1000)
                    tokens += out.new_token_ids
            computed += len(prompt) - (engine.block_manager.stats.hits - hits_before)
            history[c] = prompt + tokens
            outs[rid] = tokens
    return {"ttft_p50_ms": statistics.median(ttfts), "prefill_computed": computed,
            "ttft_ms": ttfts, "ttft_cpu_ms": cpus,
            "ttft_p50_returning_ms": statistics.median(ttfts[conversations:]),
            "outputs": outs, "device_blocks": engine.block_manager.num_blocks,
            "working_set_blocks": working_set, **_tier_stats(engine)}


def _tier_stats(engine: Any) -> dict[str, int]:
    tier = engine.block_manager.tier
    if tier is None:
        return {"offloaded": 0, "restored": 0}
    return {"offloaded": tier.stats.offloaded, "restored": tier.stats.restored}


def _abba(run: Any, repeats: int) -> dict[bool, list[dict[str, Any]]]:
    """``run(tier)`` ``repeats`` times per side, in ABBA order (off, on, on, off, ...), so
    a load that drifts during the run weighs on both sides alike."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(repeats):
        for tier in ((False, True) if i % 2 == 0 else (True, False)):
            runs[tier].append(run(tier))
    return runs


def _best_ttft(runs: list[dict[str, Any]], first: int = 0, key: str = "ttft_ms") -> float:
    """The median over requests (from the ``first``) of each request's fastest time to
    first token over the repeats: the work is the same every time, a busy machine only
    adds to it."""
    fastest = [min(ts) for ts in zip(*(r[key] for r in runs), strict=True)]
    return float(statistics.median(fastest[first:]))


_LISTS = ("outputs", "ttft_ms", "ttft_cpu_ms")  # per request: not in the results file


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (ABBA order)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from worker.models import default_model_path
    path = default_model_path()
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    n, conv = (16, 6) if args.quick else (32, 16)
    load_before = _load()
    pre = _abba(lambda t: preemption(path, t, n, vocab), args.repeats)
    long = _abba(lambda t: preemption(path, t, n, vocab, LONG_CONTEXT), args.repeats)
    multi = _abba(lambda t: multi_turn(path, t, conv, 4, vocab), args.repeats)
    rows = {
        "preemption_tok_s": [max(r["tok_s"] for r in pre[t]) for t in (False, True)],
        "multi_turn_ttft_p50_ms": [_best_ttft(multi[t]) for t in (False, True)],
        "multi_turn_ttft_p50_turns_2+_ms": [_best_ttft(multi[t], conv) for t in (False, True)],
        "preemption_tok_per_cpu_s": [max(r["tok_per_cpu_s"] for r in pre[t])
                                     for t in (False, True)],
        "preemption_long_tok_s": [max(r["tok_s"] for r in long[t]) for t in (False, True)],
        "preemption_long_tok_per_cpu_s": [max(r["tok_per_cpu_s"] for r in long[t])
                                          for t in (False, True)],
        "multi_turn_ttft_cpu_p50_ms": [_best_ttft(multi[t], key="ttft_cpu_ms")
                                       for t in (False, True)],
        "multi_turn_ttft_cpu_p50_turns_2+_ms": [_best_ttft(multi[t], conv, "ttft_cpu_ms")
                                               for t in (False, True)],
        "multi_turn_prefill_computed": [multi[t][0]["prefill_computed"] for t in (False, True)],
    }
    identical = all(r["outputs"] == runs[False][0]["outputs"]
                    for runs in (pre, long, multi) for r in runs[True] + runs[False])
    print(f"{'measurement':32} {'tier off':>12} {'tier on':>12} {'on/off':>8}")
    for name, (off, on) in rows.items():
        print(f"{name:32} {off:12.1f} {on:12.1f} {on / off:8.2f}x")
    print(f"outputs identical: {identical}; load average {load_before:.2f} -> {_load():.2f}")
    for name, runs in (("preemption", pre), ("preemption_long", long)):
        p_off, p_on = runs[False][0], runs[True][0]
        print(f"{name}: {p_off['preemptions']} / {p_on['preemptions']} preemptions, "
              f"{p_off['steps']} / {p_on['steps']} steps, tokens computed "
              f"{p_off['tokens_computed']} / {p_on['tokens_computed']}, of them recomputed "
              f"{p_off['tokens_recomputed']} / {p_on['tokens_recomputed']}; blocks restored "
              f"{p_on['restored']}, offloaded {p_on['offloaded']}")
    print(f"multi-turn: blocks restored {multi[True][0]['restored']}, offloaded "
          f"{multi[True][0]['offloaded']}")
    result = {
        "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
        "quick": args.quick, "repeats": args.repeats, "outputs_identical": identical,
        "load_average": [load_before, _load()],
        "rows": {k: {"off": off, "on": on, "ratio": on / off} for k, (off, on) in rows.items()},
        "preemption": {str(t): [{k: v for k, v in r.items() if k != "outputs"} for r in rs]
                       for t, rs in pre.items()},
        "preemption_long": {str(t): [{k: v for k, v in r.items() if k != "outputs"}
                                     for r in rs] for t, rs in long.items()},
        "multi_turn": {str(t): [{k: v for k, v in r.items() if k not in _LISTS} for r in rs]
                       for t, rs in multi.items()},
    }
    if not args.no_write:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
