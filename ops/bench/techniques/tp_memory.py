"""Weights held per rank at load: tensor-parallel 2 (gloo, CPU) beside size 1.

Each rank loads the 8-layer benchmark Llama with the per-rank loader (meta device, one
full weight resident at a time) in its own process; size 1 loads the same way unsharded.
Prints a side-by-side table and writes ``results/tp_memory.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.engine.workload import build_bench_model  # noqa: E402
from worker.engine.distributed.group import GroupSpec, close_group, init_group  # noqa: E402
from worker.engine.distributed.sharded_load import load_sharded  # noqa: E402
from worker.engine.distributed.tp_config import TPConfig  # noqa: E402


def _rank(rank: int, size: int, path: str, init: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = TPConfig(size=size, rank=rank)
    init_group(tp, GroupSpec(init, 60.0), "cpu")
    try:
        model = load_sharded(path, tp)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        Path(f"{out}.{size}.{rank}").write_text(json.dumps({"weights_mib": weights / 2**20}))
    finally:
        close_group()


def main() -> None:
    path = build_bench_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (1, 2):
            mp.spawn(_rank, args=(size, path, f"file://{tmp}/rdv{size}", f"{tmp}/r"),
                     nprocs=size, join=True)
            for rank in range(size):
                row = json.loads(Path(f"{tmp}/r.{size}.{rank}").read_text())
                rows.append({"tp": size, "rank": rank, **row})
    full = rows[0]["weights_mib"]
    print(f"{'tp':>3} {'rank':>4} {'weights MiB':>12} {'x TP1':>6}")
    for row in rows:
        row["ratio_to_tp1"] = row["weights_mib"] / full
        print(f"{row['tp']:>3} {row['rank']:>4} {row['weights_mib']:>12.1f} "
              f"{row['ratio_to_tp1']:>6.3f}")
    out = ROOT / "ops/bench/results/tp_memory.json"
    out.write_text(json.dumps({"model": "bench llama-30m (8 layers)", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
