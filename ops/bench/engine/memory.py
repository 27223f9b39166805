"""Memory check: 1,000 requests finish or abort; the KV pool must be all free again and
resident memory must not grow after warm-up. Writes ops/bench/results/memory.json.

After each wave of 100 it records RSS twice: as is, and after glibc's ``malloc_trim(0)``
hands freed heap pages back to the OS. The second is the memory actually in use; the
first also counts freed blocks the allocator keeps for reuse.

    .venv/bin/python ops/bench/engine/memory.py
"""

from __future__ import annotations

import ctypes
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.engine.workload import VOCAB, build_bench_model  # noqa: E402

WARMUP_WAVES = 10


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def wave(engine, rng: random.Random, start: int, count: int) -> None:  # type: ignore[no-untyped-def]
    from protocol.sampling import SamplingParams

    for i in range(start, start + count):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 200))]
        engine.add_request(str(i), prompt, SamplingParams(
            temperature=0.8, seed=i, max_tokens=rng.randint(1, 24), ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:  # abort a third of the wave mid-flight
            for i in range(start, start + count, 3):
                engine.abort(str(i))


def main() -> None:
    from worker import Engine, EngineConfig

    engine = Engine(EngineConfig.create(build_bench_model(), device="cpu", num_blocks=2048))
    rng = random.Random(0)
    # Warm-up: allocator pools, and oneDNN's primitive per (weight, row bucket) on CPU
    # (worker/engine/runner/cpu/packed_linear.py), which fill within ~1,000 requests and then stay
    # put.
    for n in range(WARMUP_WAVES):
        wave(engine, rng, n * 100, 100)
    before = rss_mib()
    samples, trimmed = [], []
    libc = ctypes.CDLL("libc.so.6")
    for n in range(WARMUP_WAVES, WARMUP_WAVES + 10):
        wave(engine, rng, n * 100, 100)
        samples.append(round(rss_mib(), 1))
        libc.malloc_trim(0)
        trimmed.append(round(rss_mib(), 1))
    bm = engine.block_manager
    result = {"requests": 1000, "warmup_requests": WARMUP_WAVES * 100,
              "kv_blocks_free": bm.num_free_blocks,
              "kv_blocks_total": bm.num_blocks, "rss_mib_after_warmup": round(before, 1),
              "rss_mib_per_100_requests": samples,
              "rss_mib_after_malloc_trim_per_100_requests": trimmed}
    print(json.dumps(result, indent=2))
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    out = ROOT / "ops/bench/results/memory.json"
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
