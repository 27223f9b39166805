"""CPU microbenchmark of the two hot operations of a CPU step, side by side in one run.

1. Paged decode attention over a shuffled fp32/bf16 cache (the benchmark model's heads:
   GQA 8:4, head dim 64, block size 16): the C++ kernel (``kernels/cpu_decode_attention``)
   beside the ``torch`` backend's gather + SDPA and the reference. Reported as K/V bytes
   read per second, since decode reads every cached byte once.
2. The benchmark model's linear layers (8 layers of q, k, v, o, gate, up, down): oneDNN
   with packed weights (``worker/engine/runner/cpu/packed_linear.py``) beside ``nn.Linear`` (MKL
   sgemm),
   at the row counts of decode and prefill steps.

    .venv/bin/python ops/bench/engine/cpu_ops.py      # writes ops/bench/results/cpu_ops.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from kernels import cpu_attention, cpu_decode_attention, reference  # noqa: E402
from worker.engine.runner.cpu.packed_linear import PackedLinear  # noqa: E402


def _ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def attention_rows(num_blocks: int = 3300) -> list[dict[str, object]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.randn(num_blocks, 16, 4, 64, generator=gen).to(dtype)
        v_cache = torch.randn(num_blocks, 16, 4, 64, generator=gen).to(dtype)
        for seqs, lo, hi in ((8, 100, 300), (32, 400, 720), (64, 200, 500)):
            lens = torch.randint(lo, hi, (seqs,), dtype=torch.int32, generator=gen)
            width = hi // 16 + 1
            tables = torch.randperm(num_blocks, generator=gen)[: seqs * width]
            tables = tables.view(seqs, width).to(torch.int32)
            q = torch.randn(seqs, 8, 64, generator=gen)
            args = (q, k_cache, v_cache, tables, lens, 0.125)
            kv_bytes = int(lens.sum()) * 4 * 64 * 2 * k_cache.element_size()
            impls = {
                "cpu kernel": lambda a=args: cpu_decode_attention.paged_decode_attention(*a),
                "gather+sdpa (torch backend)": lambda a=args, m=int(lens.max()):
                    cpu_attention.paged_decode_sdpa(*a, m),
                "reference": lambda a=args: reference.paged_decode_attention(*a),
            }
            for name, fn in impls.items():
                ms = _ms(fn, 10 if name == "reference" else 30)
                rows.append({"dtype": str(dtype)[6:], "seqs": seqs, "context": f"{lo}-{hi}",
                             "impl": name, "ms": round(ms, 3),
                             "kv_gb_s": round(kv_bytes / ms / 1e6, 1)})
                print(f"  attention {rows[-1]}", flush=True)
    return rows


def linear_rows() -> list[dict[str, object]]:
    torch.manual_seed(0)
    shapes = [(512, 512), (512, 256), (512, 256), (512, 512),
              (512, 1408), (512, 1408), (1408, 512)] * 8  # (in, out) of one model's layers
    plain = [nn.Linear(i, o, bias=False) for i, o in shapes]
    packed = [PackedLinear(m) for m in plain]
    rows = []
    with torch.inference_mode():
        for tokens in (1, 4, 16, 64, 256, 1024):
            xs = {i: torch.randn(tokens, i) for i in (512, 1408)}
            res = {}
            for name, mods in (("nn.Linear (MKL)", plain), ("packed oneDNN", packed)):
                res[name] = _ms(lambda m=mods, x=xs: [f(x[f.in_features]) for f in m],
                                20 if tokens <= 64 else 5)
            speedup = res["nn.Linear (MKL)"] / res["packed oneDNN"]
            rows.append({"tokens": tokens, **{k: round(v, 2) for k, v in res.items()},
                         "speedup": round(speedup, 2)})
            print(f"  linear {rows[-1]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/cpu_ops.json"))
    args = ap.parse_args()
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "attention": attention_rows(), "linear": linear_rows()}
    print(f"\n{'dtype':<9}{'seqs':>5} {'context':>9}  {'impl':<28}{'ms':>8}{'KV GB/s':>9}")
    for r in result["attention"]:  # type: ignore[union-attr]
        print(f"{r['dtype']:<9}{r['seqs']:>5} {r['context']:>9}  {r['impl']:<28}"
              f"{r['ms']:>8.2f}{r['kv_gb_s']:>9.1f}")
    print(f"\n{'tokens':>7} {'nn.Linear ms':>13} {'packed ms':>10} {'speedup':>8}")
    for r in result["linear"]:  # type: ignore[union-attr]
        print(f"{r['tokens']:>7} {r['nn.Linear (MKL)']:>13.2f} {r['packed oneDNN']:>10.2f} "
              f"{r['speedup']:>7.2f}x")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
