"""The KV cache's host tier on vs off, in one run, on the default model (CPU).

Workloads (seeded, greedy, every request exactly ``max_tokens``):

* ``preemption``: 32 requests of 64-token prompts and 192 output tokens submitted at t=0
  to a device pool of a quarter of what they need together: every prompt fits, and the
  decodes growing into it preempt running requests again and again; output tokens per
  second.
* ``multi-turn``: 16 conversations of 4 turns, served round by round (every
  conversation's turn 1, then every turn 2, ...), each turn's prompt the conversation so far
  plus a new 48-token message; the conversations' KV is 4x the device pool, so a
  conversation is evicted from the device before it comes back. Each request runs alone
  (a user waiting on it): median time to first token, and the prompt tokens computed
  (prompt tokens minus those taken from the cache, either tier).

Rows: tier off / on and their ratio; outputs compared request by request. Prints a table,
writes ``ops/bench/results/kv_tier.json``.

    .venv/bin/python ops/bench/kv_tier.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from worker.engine.text_output import TextOutputs  # noqa: E402

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


def preemption(path: str, tier: bool, n: int, vocab: int) -> dict[str, Any]:
    rng = random.Random(3)
    prompt_len, out_len = 64, 192
    jobs = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]
    demand = n * -(-(prompt_len + out_len) // BLOCK)
    engine = _engine(path, demand // 4, tier)
    start = time.perf_counter()
    for i, prompt in enumerate(jobs):
        engine.add_request(str(i), prompt, _params(out_len))
    outs: dict[str, list[int]] = {str(i): [] for i in range(n)}
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            outs[out.request_id] += out.new_token_ids
    wall = time.perf_counter() - start
    return {"tok_s": n * out_len / wall, "wall_s": wall, "outputs": outs,
            "preemptions": engine.scheduler.num_preemptions,
            "device_blocks": demand // 4, **_tier_stats(engine)}


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
    ttfts, computed, outs = [], 0, {}
    for turn in range(turns):
        for c in range(conversations):
            prompt = history[c] + messages[c][turn]
            rid = f"c{c}t{turn}"
            hits_before = engine.block_manager.stats.hits
            start = time.perf_counter()
            engine.add_request(rid, prompt, _params(answer))
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for out in TextOutputs.of(engine).step():
                    if not tokens and out.new_token_ids:
                        ttfts.append(time.perf_counter() - start)
                    tokens += out.new_token_ids
            computed += len(prompt) - (engine.block_manager.stats.hits - hits_before)
            history[c] = prompt + tokens
            outs[rid] = tokens
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000, "prefill_computed": computed,
            "outputs": outs, "device_blocks": engine.block_manager.num_blocks,
            "working_set_blocks": working_set, **_tier_stats(engine)}


def _tier_stats(engine: Any) -> dict[str, int]:
    tier = engine.block_manager.tier
    if tier is None:
        return {"offloaded": 0, "restored": 0}
    return {"offloaded": tier.stats.offloaded, "restored": tier.stats.restored}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    from worker.models import default_model_path
    path = default_model_path()
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    n, conv = (8, 6) if args.quick else (32, 16)
    pre = {t: preemption(path, t, n, vocab) for t in (False, True)}
    multi = {t: multi_turn(path, t, conv, 4, vocab) for t in (False, True)}
    rows = {
        "preemption_tok_s": (pre[False]["tok_s"], pre[True]["tok_s"]),
        "multi_turn_ttft_p50_ms": (multi[False]["ttft_p50_ms"], multi[True]["ttft_p50_ms"]),
        "multi_turn_prefill_computed": (multi[False]["prefill_computed"],
                                        multi[True]["prefill_computed"]),
    }
    identical = pre[False]["outputs"] == pre[True]["outputs"] and \
        multi[False]["outputs"] == multi[True]["outputs"]
    print(f"{'measurement':32} {'tier off':>12} {'tier on':>12} {'on/off':>8}")
    for name, (off, on) in rows.items():
        print(f"{name:32} {off:12.1f} {on:12.1f} {on / off:8.2f}x")
    print(f"outputs identical: {identical}; preemptions {pre[False]['preemptions']} / "
          f"{pre[True]['preemptions']}; restored blocks {pre[True]['restored']} / "
          f"{multi[True]['restored']}")
    result = {
        "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
        "quick": args.quick, "outputs_identical": identical,
        "rows": {k: {"off": off, "on": on, "ratio": on / off} for k, (off, on) in rows.items()},
        "preemption": {str(t): {k: v for k, v in r.items() if k != "outputs"}
                       for t, r in pre.items()},
        "multi_turn": {str(t): {k: v for k, v in r.items() if k != "outputs"}
                       for t, r in multi.items()},
    }
    if not args.no_write:
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
