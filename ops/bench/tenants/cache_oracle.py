"""The prefix-cache timing oracle, measured as the attack measured it: can tenant B tell,
from its time to first token, that tenant A just sent a prompt?

The real stack (``ferry up``: Redis, gateway, one worker on the default model, the CPU),
with a tenants file of four keys: ``alpha`` and ``beta`` each in their own prefix-cache
space (the default), ``gamma`` and ``delta`` in one ``prefix_cache_group`` (an operator
sharing on purpose: the control, where the oracle must show). Each trial, on prompts of
``--tokens`` random token ids (~1,000) new to the whole stack:

* alpha sends prompt P (warms alpha's cache), gamma sends prompt Q (the group's);
* then, in a shuffled order: alpha repeating P, beta sending P (the attack), beta sending
  a fresh prompt of the same length, delta sending Q (shared on purpose), each timed.

Every request streams one completion (greedy, 2 tokens) and is timed from its send to its
first token; ``cached`` is the usage's ``prompt_tokens_details.cached_tokens`` the caller
was shown. *Separable* is the attack's test: every "B sends A's prompt" TTFT lies outside
the range of the fresh prompts' TTFTs. Writes ``ops/bench/results/cache_oracle.json``::

    .venv/bin/python ops/bench/tenants/cache_oracle.py              # 8 trials of 1,000 tokens
    .venv/bin/python ops/bench/tenants/cache_oracle.py --trials 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from ops.bench.service import ferry_up  # noqa: E402

RESULT = ROOT / "ops" / "bench" / "results" / "cache_oracle.json"
TENANTS = ("alpha", "beta", "gamma", "delta")
VOCAB = 8192  # the default model's (worker/models/default/config.json)
ROWS = ("A repeats its prompt", "B sends A's prompt", "B sends a fresh prompt",
        "D sends C's prompt (shared group)")


def _tenants_file(path: Path) -> None:
    sha = {t: hashlib.sha256(f"{t}-key".encode()).hexdigest() for t in TENANTS}
    path.write_text("".join(
        f'[tenants.{t}]\nkeys_sha256 = ["{sha[t]}"]\n'
        + ('prefix_cache_group = "public"\n' if t in ("gamma", "delta") else "") + "\n"
        for t in TENANTS))


def start_ferry(tenants: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``ferry up`` with one worker (the default model, this CPU) and the tenants file."""
    env = dict(os.environ, FERRY_DEVICE="cpu", FERRY_TENANTS_FILE=str(tenants))
    env.pop("FERRY_API_KEYS", None)
    return ferry_up.start_ferry(env, log)


def timed(client: httpx.Client, base: str, who: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion as ``who``: seconds to the first token, and the cached
    prompt tokens its final usage reports."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {who}-key"}
    t0 = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with client.stream("POST", base + "/v1/completions", json=body, headers=headers,
                       timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "prompt_tokens": usage.get("prompt_tokens"),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def trial(client: httpx.Client, base: str, rng: random.Random, tokens: int
          ) -> dict[str, dict[str, Any]]:
    def fresh() -> list[int]:
        return [rng.randrange(100, VOCAB - 100) for _ in range(tokens)]

    p, q = fresh(), fresh()
    timed(client, base, "alpha", p)  # A's prompt, now in A's cache
    timed(client, base, "gamma", q)  # C's, in the group's
    plan = [(ROWS[0], "alpha", p), (ROWS[1], "beta", p), (ROWS[2], "beta", fresh()),
            (ROWS[3], "delta", q)]
    rng.shuffle(plan)  # no row always runs first, or right after a warm-up
    return {name: timed(client, base, who, prompt) for name, who, prompt in plan}


def summarize(trials: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    rows = {}
    for name in ROWS:
        ttft = [1000 * t[name]["ttft_s"] for t in trials]
        cached = [t[name]["cached"] for t in trials]
        rows[name] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_min": min(ttft),
                      "ttft_ms_max": max(ttft), "cached_tokens": cached,
                      "prompt_tokens": trials[0][name]["prompt_tokens"], "ttft_ms": ttft}
    lo, hi = rows[ROWS[2]]["ttft_ms_min"], rows[ROWS[2]]["ttft_ms_max"]

    def outside(name: str) -> int:
        return sum(not lo <= x <= hi for x in rows[name]["ttft_ms"])

    return {"rows": rows, "fresh_range_ms": [lo, hi],
            "attack_outside_fresh_range": outside(ROWS[1]),
            "attack_separable": outside(ROWS[1]) == len(trials),
            "shared_group_outside_fresh_range": outside(ROWS[3]),
            "shared_group_separable": outside(ROWS[3]) == len(trials)}


def report(summary: dict[str, Any], trials: int) -> None:
    print(f"{'':36} {'median ms':>10} {'min ms':>8} {'max ms':>8}  cached tokens (shown)")
    for name, row in summary["rows"].items():
        print(f"{name:36} {row['ttft_ms_median']:10.1f} {row['ttft_ms_min']:8.1f} "
              f"{row['ttft_ms_max']:8.1f}  {row['cached_tokens']}")
    print(f"B sends A's prompt outside the fresh range in "
          f"{summary['attack_outside_fresh_range']}/{trials} trials: separable "
          f"{summary['attack_separable']}")
    print(f"shared group (control) outside it in "
          f"{summary['shared_group_outside_fresh_range']}/{trials}: separable "
          f"{summary['shared_group_separable']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as name:
        tenants, log = Path(name) / "tenants.toml", Path(name) / "up.log"
        _tenants_file(tenants)
        proc, base = start_ferry(tenants, log)
        try:
            with httpx.Client() as client:
                for who in TENANTS:  # warm-up: the first requests pay one-time costs
                    timed(client, base, who, [rng.randrange(100, VOCAB - 100)
                                              for _ in range(args.tokens)])
                trials = [trial(client, base, rng, args.tokens) for _ in range(args.trials)]
        finally:
            ferry_up.stop_ferry(proc)
    summary = summarize(trials)
    report(summary, args.trials)
    out = {"bench": "cache_oracle", "trials": args.trials, "prompt_tokens": args.tokens,
           "model": "default", "device": "cpu", "cpus": os.cpu_count(), **summary,
           "seconds": round(time.monotonic() - started, 1),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
