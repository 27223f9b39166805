"""What one affinity bench run adds up to (``affinity.py`` drives it): each phase's
summary (cached tokens, time to first token, throughput, each worker's share), the
workers' ``request_timeline`` lines read back and each later turn's time to first token
in parts, the checks against the targets, the printed tables and the results file's
records."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def summarize(phase: dict[str, Any]) -> dict[str, Any]:
    recs = phase["records"]
    later = [r for r in recs if r["turn"] >= 2]
    tokens = sum(r["prompt"] + r["completion"] for r in recs)
    ttft = sorted(r["ttft_s"] for r in later if r["ttft_s"] is not None)
    per_worker: dict[str, int] = {}
    for r in recs:  # the tokens each worker computed (prefill not served from cache + decode)
        per_worker[r["worker"]] = per_worker.get(r["worker"], 0) + \
            r["prompt"] - r["cached"] + r["completion"]
    done = sum(per_worker.values()) or 1
    ran_on = {(r["conv"], r["turn"]): r["worker"] for r in recs}
    return {
        "requests": len(recs), "finished": sum(r["state"] == "done" for r in recs),
        "cached_tokens_turns_2_on": sum(r["cached"] for r in later),
        "prompt_tokens_turns_2_on": sum(r["prompt"] for r in later),
        "ttft_median_s_turns_2_on": statistics.median(ttft),
        "ttft_mean_s_turns_2_on": statistics.mean(ttft),
        "ttft_p90_s_turns_2_on": ttft[int(0.9 * (len(ttft) - 1))],
        # turns 2.. that found less than half their prompt cached: recomputed elsewhere
        "misses_turns_2_on": sum(r["cached"] < r["prompt"] / 2 for r in later),
        # turns 2.. that ran on the worker of the conversation's previous turn: 1/N of
        # them when any worker may pull a request and pulls are uncorrelated with it
        "same_worker_turns_2_on": sum(
            ran_on.get((r["conv"], r["turn"] - 1)) == r["worker"] for r in later),
        "throughput_tok_s": tokens / phase["wall_s"], "wall_s": phase["wall_s"],
        "computed_share": {w: round(n / done, 3) for w, n in sorted(per_worker.items())},
        "max_queued_s": max((r["queued_s"] or 0) for r in recs),
    }


PARTS = ("queue_s", "prepare_s", "mailbox_s", "engine_wait_s", "prefill_s")


def timelines(log: Path) -> dict[str, dict[str, Any]]:
    """The workers' ``request_timeline`` lines (``worker/service/ttft_trace.py``, logged
    at debug level) by request id."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if "request_timeline" in line and "{" in line:
            try:
                event = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            out[str(event.get("request_id"))] = event
    return out


def breakdown(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns 2..T: each part of the time to first token (median and mean), overall, per
    route (offered to its holder and taken there, stolen by the other worker after the
    steal time, unmarked) and for cache hits and misses."""
    later = [r for r in records if r["turn"] >= 2 and r.get("trace")]
    steps: dict[tuple[str, float], int] = {}  # (worker, step start) -> requests it started
    for r in records:
        if r.get("trace"):
            step = (r["trace"]["worker"], r["trace"]["scheduled_at"])
            steps[step] = steps.get(step, 0) + 1

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {"n": 0}
        out: dict[str, Any] = {"n": len(rows)}
        for part in (*PARTS, "ttft_s"):
            xs = [r["trace"][part] for r in rows]
            out[part] = {"median": round(statistics.median(xs), 4),
                         "mean": round(statistics.mean(xs), 4)}
        client = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        if client:
            out["client_ttft_s"] = {"median": round(statistics.median(client), 4),
                                    "mean": round(statistics.mean(client), 4)}
        together = [steps[(r["trace"]["worker"], r["trace"]["scheduled_at"])] for r in rows]
        out["first_scheduled_with"] = {"median": statistics.median(together),
                                       "mean": round(statistics.mean(together), 2)}
        waits = [r["trace"]["mark_wait_s"] for r in rows
                 if r["trace"].get("mark_wait_s") is not None]
        if waits:
            out["mark_wait_s"] = {"median": round(statistics.median(waits), 4),
                                  "max": round(max(waits), 4)}
        return out

    by_route: dict[str, list[dict[str, Any]]] = {}
    for r in later:
        by_route.setdefault(r["trace"]["route"], []).append(r)
    return {"all": stats(later), "routes": {k: stats(v) for k, v in sorted(by_route.items())},
            "hits": stats([r for r in later if r["cached"] >= r["prompt"] / 2]),
            "misses": stats([r for r in later if r["cached"] < r["prompt"] / 2])}


def report(results: dict[str, Any], phases: dict[str, Any], args: Any) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    on, off, single = results.get("on"), results.get("off"), results.get("single")
    if on and single:
        checks["cached_vs_one_worker"] = round(
            on["cached_tokens_turns_2_on"] / max(1, single["cached_tokens_turns_2_on"]), 3)
    if on and off:
        for stat in ("median", "mean", "p90"):
            checks[f"ttft_{stat}_on_vs_off"] = round(on[f"ttft_{stat}_s_turns_2_on"]
                                                     / off[f"ttft_{stat}_s_turns_2_on"], 3)
        checks["throughput_on_vs_off"] = round(on["throughput_tok_s"]
                                               / off["throughput_tok_s"], 3)
    if "skewed" in results:
        checks["skewed_computed_share"] = results["skewed"]["computed_share"]
    if "kill" in results and "on" in phases:
        undisturbed = {(r["conv"], r["turn"]): r["text"] for r in phases["on"]["records"]}
        killed = {(r["conv"], r["turn"]): r["text"] for r in phases["kill"]["records"]}
        checks["kill_all_finished"] = results["kill"]["finished"] == results["kill"]["requests"]
        checks["kill_outputs_identical"] = sum(undisturbed.get(k) == v for k, v in killed.items())
        checks["kill_requests"] = len(killed)
        checks["kill_max_queued_s"] = results["kill"]["max_queued_s"]
        checks["kill_held_requests_resumed_after_s"] = results["kill"].get("resumed")
    print(f"{'phase':8} {'cached t2+':>10} {'of prompt':>10} {'misses':>6} {'same':>5} "
          f"{'ttft p50':>8} {'mean':>6} {'p90':>6} {'tok/s':>8} {'wall s':>7}  computed share")
    for p, s in results.items():
        print(f"{p:8} {s['cached_tokens_turns_2_on']:10d} {s['prompt_tokens_turns_2_on']:10d} "
              f"{s['misses_turns_2_on']:6d} {s['same_worker_turns_2_on']:5d} "
              f"{s['ttft_median_s_turns_2_on']:8.3f} "
              f"{s['ttft_mean_s_turns_2_on']:6.3f} {s['ttft_p90_s_turns_2_on']:6.3f} "
              f"{s['throughput_tok_s']:8.1f} {s['wall_s']:7.1f}  {s['computed_share']} "
              f"{s['routes']}")
    print("time to first token, turns 2..T, median / mean s: " + ", ".join(PARTS))
    for p, s in results.items():
        parts = s.get("ttft_parts_turns_2_on", {})
        for group, st in [("all", parts.get("all", {})), *parts.get("routes", {}).items(),
                          ("hits", parts.get("hits", {})), ("misses", parts.get("misses", {}))]:
            if st.get("n"):
                cells = " ".join(f"{st[k]['median']:.3f}/{st[k]['mean']:.3f}" for k in PARTS)
                print(f"{p:8} {group:9} n={st['n']:2d} {cells}  worker ttft "
                      f"{st['ttft_s']['median']:.3f}  client "
                      f"{st.get('client_ttft_s', {}).get('median', float('nan')):.3f}"
                      f"  mark wait {st.get('mark_wait_s')}  started with "
                      f"{st['first_scheduled_with']}")
    print(json.dumps(checks, indent=1))
    return {"bench": "affinity", "conversations": args.conversations, "turns": args.turns,
            "workers": args.workers, "think_s": args.think_s,
            "kv_blocks": args.kv_blocks, "answer_tokens": args.answer_tokens,
            "system_words": args.system_words, "steal_ms": args.steal_ms, "model": "default",
            "device": "cpu", "phases": results, "checks": checks,
            "records": {p: [record(r) for r in ph["records"]] for p, ph in phases.items()}}


def record(r: dict[str, Any]) -> dict[str, Any]:
    """One request as the results file keeps it: no text, and of its timeline the route
    and the parts only."""
    out = {k: v for k, v in r.items() if k not in ("text", "trace")}
    trace = r.get("trace")
    if trace:
        out["trace"] = {k: trace.get(k) for k in ("route", "mark_wait_s", *PARTS)}
    return out
