"""Replay of ``spec_decode.py``'s batch-1 repeat workload through the proposer, no model.

Greedy outputs do not depend on speculation, so once the first answers and continuations
are known (one run with speculation off), feeding them through the real
``SuffixProposer`` and ``AcceptanceModel`` one request at a time, as the engine does at
batch 1, gives exactly the drafts the engine would verify and the tokens it would accept:
the benchmark's step counts, and where the steps go (no match, a one-token match, a draft
the back-off cut to nothing, a draft rejected at its first token, drafts accepted).
Proposer and back-off settings can be compared in seconds this way; only their CPU cost
needs the benchmark.

    python ops/bench/techniques/spec_replay.py [--n 64] [--costs 20,0.55,3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.techniques.spec_decode import continuation_jobs, repeat_jobs, run_setting  # noqa: E402
from protocol.tenants.ids import DEFAULT_TENANT as TENANT  # noqa: E402
from worker.engine.speculative.backoff import AcceptanceModel  # noqa: E402
from worker.engine.speculative.config import SpeculativeConfig  # noqa: E402
from worker.engine.speculative.suffix_proposer import SuffixProposer  # noqa: E402


def greedy_outputs(path: str, n: int, out: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """(prompt, output) of the benchmark's first answers and continuations, speculation
    off, batch 1."""
    repeat, spans = repeat_jobs(n, out), continuation_jobs(path, n, out)
    got = run_setting(path, {"repeat, 1st": (repeat, 1), "cont, 1st": (spans, 1)}, {})
    return {part: [(j.prompt, o) for j, o in zip(jobs, got[key]["outs"], strict=True)]
            for part, key, jobs in (("1st pass", "repeat, 1st", repeat),
                                    ("continue", "cont, 1st", spans))}


def replay(pairs: list[tuple[list[int], list[int]]], proposer: SuffixProposer,
           model: AcceptanceModel, tag: str) -> dict[str, Any]:
    """One request at a time: the steps the engine takes at batch 1 and why."""
    kinds: Counter[str] = Counter()
    steps = drafted = accepted = 0
    for i, (prompt, out) in enumerate(pairs):
        rid = f"{tag}{i}"
        proposer.start(rid, prompt + out[:1], TENANT)  # the prefill step samples the first
        steps, n = steps + 1, 1
        while n < len(out):
            limit = len(out) - n - 1
            draft = proposer.propose(rid, limit) if limit > 0 else None
            k = 0
            if draft is not None and draft.tokens:
                k = model.draft_length(rid, TENANT, draft.source, draft.match_length,
                                       len(draft.tokens), 1)
            tokens = draft.tokens[:k] if draft is not None else []
            a = 0
            while a < len(tokens) and tokens[a] == out[n + a]:
                a += 1
            if tokens:
                assert draft is not None
                model.record(rid, TENANT, draft.source, draft.match_length, len(tokens), a)
                drafted, accepted = drafted + len(tokens), accepted + a
                kinds["accepted" if a else "rejected"] += 1
            elif draft is not None and draft.tokens:
                kinds["cut by the back-off"] += 1
            else:
                kinds["no draft"] += 1
            proposer.observe(rid, out[n:n + a + 1])
            steps, n = steps + 1, n + a + 1
        proposer.finish(rid, len(prompt))
        model.forget(rid)
    return {"steps": steps, "drafted": drafted, "accepted": accepted, "kinds": dict(kinds)}


def main() -> None:
    from worker.models import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64, help="requests per part")
    ap.add_argument("--out", type=int, default=64, help="output tokens")
    ap.add_argument("--costs", default=None, help="overhead_rows,token_cost,step_cost")
    ap.add_argument("--set", nargs="*", default=[], help="SpeculativeConfig key=value")
    args = ap.parse_args()
    kw: dict[str, Any] = {k: float(v) if "." in v else int(v)
                          for k, v in (item.split("=") for item in args.set)}
    if args.costs:
        o, t, s = (float(x) for x in args.costs.split(","))
        kw.update(overhead_rows=o, draft_token_cost=t, draft_step_cost=s)
    config = SpeculativeConfig(method="suffix", **kw)
    outputs = greedy_outputs(default_model_path(), args.n, args.out)
    proposer, model = SuffixProposer(config), AcceptanceModel(config.costs)
    parts = (("1st pass", outputs["1st pass"]), ("retries", outputs["1st pass"]),
             ("continue", outputs["continue"]))  # one engine: the store carries over
    for k, (part, pairs) in enumerate(parts):
        r = replay(pairs, proposer, model, f"p{k}-")
        print(f"{part:<9} steps {r['steps']:>5}  drafted {r['drafted']:>5}  accepted "
              f"{r['accepted']:>5}  {r['kinds']}")


if __name__ == "__main__":
    main()
