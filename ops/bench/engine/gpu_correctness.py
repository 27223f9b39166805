"""GPU correctness: the fast CUDA path against the plain one, per architecture.

    python ops/bench/engine/gpu_correctness.py [--device cuda] [--out FILE]

For each correctness checkpoint (Llama, Mistral, Qwen2, Qwen3; seeded random weights,
``tests/checkpoints.py``) the same greedy requests run under four engine settings:

* ``eager``: every step eager, steps not overlapped (the plain path, the reference);
* ``graphs+overlap``: the defaults on CUDA (decode steps replay CUDA graphs, step N+1 is
  launched before step N is read back);
* ``eager, chunked+preempt`` and ``graphs+overlap, chunked+preempt``: a 32-token step
  budget (prompts split over steps) and a KV pool of a third of the demand (requests
  preempted and recomputed).

Each row says how many requests match the reference token for token and whether the graphs
were captured (``decode_graphs_active``). Seeded sampling (temperature 0.8, top-p 0.9) is
checked across batch sizes: one request alone and the same request among 15 others.
It also runs on a CPU (``--device cpu``), where there are no graphs to capture.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # before this folder, whose kernels.py shadows the package

from protocol.sampling import SamplingParams  # noqa: E402
from tests.checkpoints import ARCHS, build_checkpoint  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "eager": dict(enforce_eager=True, async_scheduling=False),
    "graphs": dict(enforce_eager=False, async_scheduling=False),
    "overlap": dict(enforce_eager=True, async_scheduling=True),
    "graphs+overlap": dict(enforce_eager=False, async_scheduling=True),
    "eager, chunked+preempt": dict(enforce_eager=True, async_scheduling=False,
                                   chunked=True),
    "graphs+overlap, chunked+preempt": dict(enforce_eager=False, async_scheduling=True,
                                            chunked=True),
}


def _prompts(vocab: int, n: int = 12, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def run_engine(path: str, device: str, requests: dict[str, tuple[list[int], SamplingParams]],
               chunked: bool = False, **kw: Any) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Token ids per request and the engine's health after the run."""
    from worker import Engine, EngineConfig
    from worker.engine.output.text_output import TextOutputs

    demand = sum(len(p) + s.max_tokens for p, s in requests.values())
    # a small host tier: swaps and host hits run through real pinned memory, without
    # pinning the default 10% of RAM for each of the run's many engines
    extra: dict[str, Any] = dict(max_num_seqs=16, host_memory_bytes=256 << 20,
                                 memory_bytes=1 << 30)
    if chunked:  # a third of the demand in blocks of 16: preemption is certain
        extra.update(num_blocks=max(12, demand // 48), max_num_batched_tokens=32,
                     long_prefill_token_threshold=16)
    engine = Engine(EngineConfig.create(path, device=device, block_size=16, **extra, **kw))
    outs: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs[out.request_id].extend(out.new_token_ids)
    health = {"decode_graphs_active": engine.runner.health.decode_graphs_active,
              "degraded": dict(engine.runner.health.reasons),
              "preemptions": engine.scheduler.num_preemptions}
    del engine
    _free(device)
    return outs, health


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def check_arch(arch: str, root: Path, device: str, dtype: str) -> dict[str, Any]:
    path = build_checkpoint(arch, root, hidden=64, max_pos=512)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    greedy = {f"g{i}": (p, SamplingParams(temperature=0, max_tokens=24 + i * 3, ignore_eos=True))
              for i, p in enumerate(_prompts(vocab))}
    result: dict[str, Any] = {"arch": arch, "dtype": dtype, "requests": len(greedy),
                              "settings": {}}
    reference: dict[str, list[int]] | None = None
    for name, kw in SETTINGS.items():
        start = time.perf_counter()
        outs, health = run_engine(path, device, greedy, dtype=dtype, **kw)
        reference = reference or outs
        same = sum(outs[r] == reference[r] for r in greedy)
        result["settings"][name] = {"identical": same, "seconds": round(
            time.perf_counter() - start, 2), **health,
            "first_difference": {r: _first_difference(outs[r], reference[r])
                                 for r in greedy if outs[r] != reference[r]}}
        print(f"  {arch:<8} {dtype:<9} {name:<32} {same}/{len(greedy)} identical {health} "
              f"{result['settings'][name]['first_difference'] or ''}", flush=True)
    result["seeded_across_batch_sizes"] = seeded_check(path, device, vocab, dtype)
    return result


def _first_difference(a: list[int], b: list[int]) -> int:
    """The output index where two token lists first part (a long request's tail can
    differ after a near-tie at that index; an early index is a real fault)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def seeded_check(path: str, device: str, vocab: int, dtype: str) -> bool:
    """One seeded sampled request alone and among 15 others: the same tokens."""
    prompts = _prompts(vocab, n=16, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=24,
                             ignore_eos=True) for i in range(16)]
    alone, _ = run_engine(path, device, {"s0": (prompts[0], params[0])}, dtype=dtype)
    crowd, _ = run_engine(path, device, {f"s{i}": (prompts[i], params[i]) for i in range(16)},
                          dtype=dtype)
    same = alone["s0"] == crowd["s0"]
    print(f"  seeded sampling alone vs batch of 16: {'identical' if same else 'DIFFERENT'}",
          flush=True)
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--archs", nargs="*", default=list(ARCHS))
    ap.add_argument("--dtypes", nargs="*", default=["auto"], help="auto: bf16 on CUDA")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [check_arch(a, Path(tmp), args.device, d)
                   for a in args.archs for d in args.dtypes]
    ok = all(s["identical"] == r["requests"] for r in results for s in r["settings"].values())
    ok = ok and all(r["seeded_across_batch_sizes"] for r in results)
    print("ALL IDENTICAL" if ok else "MISMATCHES: see above", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": args.device, "ok": ok,
                                              "archs": results}, indent=2))


if __name__ == "__main__":
    main()
