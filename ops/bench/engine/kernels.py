"""Decode-attention microbenchmark: the Triton paged kernel beside torch SDPA.

For each (batch, context) it times, on one device in one run:
  * ``triton``         paged_decode_attention, split count from the heuristic
  * ``triton 1-split`` the same kernel with split-KV off (shows what splitting buys)
  * ``gather+sdpa``    gather the paged K/V into contiguous tensors, then SDPA (the naive
                       paged path), timed together
  * ``sdpa``           SDPA alone on already-contiguous K/V (a lower bound for torch)
and reports achieved bandwidth (K/V bytes read / time) and its share of the device's
peak HBM bandwidth. Decode reads every cached K/V byte once per step, so bandwidth,
not FLOPs, is the figure of merit.

    python ops/bench/engine/kernels.py                                   # CUDA GPU
    TRITON_INTERPRET=1 python ops/bench/engine/kernels.py --smoke        # CPU: plumbing only

Results go to ``ops/bench/results/kernels-<device>.json`` (``--out`` to override).
``--smoke`` uses tiny shapes under the Triton interpreter: its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[3]
GPU_BATCHES, GPU_CONTEXTS = (1, 8, 64, 256), (512, 4096, 32768)
SMOKE_BATCHES, SMOKE_CONTEXTS = (1, 2), (16, 300)  # 300: exercises split-KV
MEMORY_HEADROOM = 0.85  # use at most this share of free device memory


def peak_bandwidth_gbps(device_name: str) -> float | None:
    """Peak HBM bandwidth from the device name; None when unknown (printed as n/a)."""
    if "H200" in device_name:
        return 4800.0
    if "H100" in device_name and not re.search("PCIe|NVL", device_name):
        return 3350.0  # H100 SXM
    return None


def _timer(fn: Callable[[], object], cuda: bool) -> float:
    """Milliseconds per call: CUDA events via do_bench on a GPU, wall clock otherwise."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # warm-up (the interpreter traces on the first call)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _make_inputs(args: argparse.Namespace, batch: int, context: int, device: torch.device):
    """A shuffled paged cache holding `batch` contexts of `context` tokens each."""
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = math.ceil(context / args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, block_tables, seq_lens


def _fits(args: argparse.Namespace, batch: int, context: int, copies: int, cuda: bool) -> bool:
    if not cuda:
        return True
    free, _ = torch.cuda.mem_get_info()
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
    return copies * kv_bytes < MEMORY_HEADROOM * free


def _import_kernels():
    """Import the repo's ``kernels`` package, not this file.

    Run as a script, this file's folder is ``sys.path[0]`` and its own name is
    ``kernels``, so a plain import would find the benchmark itself.
    """
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(ROOT))
    import kernels.decode_attention
    import kernels.decode_splits
    import kernels.reference

    return kernels


def bench_one(args: argparse.Namespace, batch: int, context: int, cuda: bool) -> dict:
    """Time every variant for one (batch, context); returns one result row."""
    kernels = _import_kernels()
    choose_num_kv_splits = kernels.decode_splits.choose_num_kv_splits
    paged_decode_attention = kernels.decode_attention.paged_decode_attention
    reference = kernels.reference
    row: dict = {"batch": batch, "context": context}
    if not _fits(args, batch, context, copies=1, cuda=cuda):
        return row | {"skipped": "K/V cache does not fit in free device memory"}
    device = torch.device("cuda" if cuda else "cpu")
    q, kc, vc, tables, lens = _make_inputs(args, batch, context, device)
    scale = args.head_dim**-0.5
    out = torch.empty_like(q)
    elem = q.element_size()
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 132
    row["splits"] = choose_num_kv_splits(batch, args.kv_heads, context, sms)
    row["kv_bytes"] = kv_bytes

    def triton_auto() -> torch.Tensor:
        return paged_decode_attention(q, kc, vc, tables, lens, scale, out=out, max_seq_len=context)

    def triton_one() -> torch.Tensor:
        return paged_decode_attention(q, kc, vc, tables, lens, scale, out=out, num_kv_splits=1)

    row["triton_ms"] = _timer(triton_auto, cuda)
    row["triton_1split_ms"] = _timer(triton_one, cuda)
    if _fits(args, batch, context, copies=2, cuda=cuda):
        q4 = q.unsqueeze(2)  # [B, Hq, 1, D]

        def gathered() -> tuple[torch.Tensor, torch.Tensor]:
            nb = tables.shape[1]  # [B, L, Hkv, D] -> [B, Hkv, L, D]
            k = reference.gather_kv(kc, tables, nb)[:, :context].transpose(1, 2)
            v = reference.gather_kv(vc, tables, nb)[:, :context].transpose(1, 2)
            return k, v

        def gather_sdpa() -> torch.Tensor:
            k, v = gathered()
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        k, v = (t.contiguous() for t in gathered())
        row["gather_sdpa_ms"] = _timer(gather_sdpa, cuda)
        row["sdpa_ms"] = _timer(
            lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True), cuda
        )
        want = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        row["max_abs_diff"] = float((triton_auto().float() - want.squeeze(2).float()).abs().max())
    else:
        row["note"] = "gathered K/V copy does not fit: SDPA columns skipped"
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], peak: float | None) -> None:
    head = ("batch", "ctx", "splits", "triton ms", "GB/s", "%peak", "1-split ms",
            "gather+sdpa ms", "sdpa ms", "sdpa GB/s", "max|diff|")  # fmt: skip
    print(" ".join(f"{h:>14}" for h in head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['batch']:>14} {r['context']:>14}  skipped: {r['skipped']}")
            continue
        gbps = r["kv_bytes"] / r["triton_ms"] / 1e6
        sdpa = r.get("sdpa_ms")
        cells = (r["batch"], r["context"], r["splits"], _fmt(r["triton_ms"], ".4f"),
                 _fmt(gbps, ".1f"), "n/a" if peak is None else f"{100 * gbps / peak:.1f}%",
                 _fmt(r["triton_1split_ms"], ".4f"), _fmt(r.get("gather_sdpa_ms"), ".4f"),
                 _fmt(sdpa, ".4f"), _fmt(sdpa and r["kv_bytes"] / sdpa / 1e6, ".1f"),
                 _fmt(r.get("max_abs_diff"), ".2e"))  # fmt: skip
        print(" ".join(f"{c!s:>14}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = p.parse_args(argv)
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 64, 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels is imported
    import triton

    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_bandwidth_gbps(name) if cuda else None
    batches, contexts = (GPU_BATCHES, GPU_CONTEXTS) if cuda else (SMOKE_BATCHES, SMOKE_CONTEXTS)
    rows = [bench_one(args, b, c, cuda) for b in batches for c in contexts]
    shape = f"Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} block={args.block_size}"
    print(f"device: {name}  peak: {_fmt(peak, '.0f')} GB/s  dtype: {args.dtype}  {shape}")
    print_table(rows, peak)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    path = args.out or ROOT / "ops" / "bench" / "results" / f"kernels-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "peak_gbps": peak, "smoke": args.smoke, "config": vars(args)
              | {"out": str(path)}, "torch": torch.__version__, "triton": triton.__version__,
              "results": rows}  # fmt: skip
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
