"""Gateway token-path bench: how many token events/s one ``ferry gateway`` delivers over SSE.

No model, no GPU: a synthetic worker (``event_publisher.py``) takes the requests the
gateway enqueues and publishes protocol-correct TokenEvents through the worker's own
fenced push at a controlled rate; real SSE clients (``sse_clients.py``, several processes
so they are never the bottleneck) open N streaming completions through a real ``ferry
gateway`` subprocess on a real ``redis-server``. Reported per row: events/s delivered in
the measurement window, latency publish -> client receipt (p50/p99), the gateway's CPU%
(and events per gateway CPU-second, the number that carries over to a machine with a
free core for it), the clients' CPU%, and whether every event arrived once, in order.

Rows run side by side in one run: ``--baseline REF`` adds the same rows for another git
revision's gateway (extracted with ``git archive``), and the "pure-Python libs" rows hide
hiredis, uvloop, httptools and orjson from the gateway process (a ``sitecustomize`` that
blocks their import), which is how the stack ran before they were dependencies. Usage:

    .venv/bin/python ops/bench/service/gateway_events.py                  # 256 streams
    .venv/bin/python ops/bench/service/gateway_events.py --baseline 8606a9b
    .venv/bin/python ops/bench/service/gateway_events.py --quick          # 32 streams, short
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.service.gateway_procs import (  # noqa: E402
    C_LIBS,
    GatewayConfig,
    cpu_between,
    run_row,
)

ROWS_DOC = "row: gateway source, blocked C libs, offered events/s"


def configs(baseline: str | None, tmp: Path, libs_off: bool) -> list[GatewayConfig]:
    out: list[GatewayConfig] = []
    sources = [("this tree", ROOT)]
    if baseline:
        sources.insert(0, (f"baseline {baseline}", _extract(baseline, tmp)))
    for label, src in sources:
        if libs_off:
            out.append(GatewayConfig(f"{label}, pure-Python libs", src, C_LIBS))
        out.append(GatewayConfig(f"{label}, C libs", src, ()))
    return out


def _extract(ref: str, tmp: Path) -> Path:
    import subprocess

    dest = tmp / f"src-{ref}"
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(cfg: GatewayConfig, raw: dict[str, Any]) -> dict[str, Any]:
    pub, clients, samples = raw["publisher"], raw["clients"], raw["gateway_cpu"]
    t0, t1 = pub["window"]
    lat, delivered = [], 0
    from array import array

    for c in clients:
        recv, sent = array("d"), array("d")
        recv.frombytes(c["recv"])
        sent.frombytes(c["pub"])
        for r, p in zip(recv, sent, strict=True):
            if t0 <= p <= t1:
                lat.append((r - p) * 1000)
            if t0 <= r <= t1:
                delivered += 1
    span = max(t1 - t0, 1e-9)
    gw_cpu = cpu_between(samples, t0, t1)
    streams = {rid: s for c in clients for rid, s in c["streams"].items()}
    correct = sum(1 for s in streams.values() if not s["errors"] and s["finished"]
                  and s["done"] and s["events"] == pub["steps"])
    client_cpu = sum(c["cpu_s"] for c in clients) / max(max(c["wall_s"] for c in clients), 1e-9)
    return {
        "row": cfg.label, "streams": len(streams), "offered_events_s": pub["offered_rate"],
        "published_events_s": round(pub["measured_events"] / span, 1),
        "delivered_events_s": round(delivered / span, 1),
        "latency_ms": {"p50": round(_pct(lat, 0.5), 2), "p99": round(_pct(lat, 0.99), 2)},
        "gateway_cpu_pct": round(100 * gw_cpu, 1),
        "events_per_gateway_cpu_s": round(delivered / span / gw_cpu, 1) if gw_cpu else None,
        "client_cpu_pct": round(100 * client_cpu / len(clients), 1),
        "client_processes": len(clients), "refused_pushes": pub["refused"],
        "pubsub_overflows": raw["pubsub_overflows"],
        "streams_correct": correct, "events_per_stream": pub["steps"],
        "errors": [f"{rid}: {s['errors'][:2]}" for rid, s in streams.items() if s["errors"]][:5],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'row':<38} {'offered':>8} {'published':>9} {'delivered':>9} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'gw cpu':>7} {'ev/gw-cpu-s':>11} {'cli cpu':>7} {'correct':>8}")
    lines = [head]
    for r in rows:
        lat = r["latency_ms"]
        per = r["events_per_gateway_cpu_s"] or 0
        lines.append(
            f"{r['row']:<38} {r['offered_events_s']:>8.0f} {r['published_events_s']:>9.0f} "
            f"{r['delivered_events_s']:>9.0f} {lat['p50']:>8.1f} {lat['p99']:>8.1f} "
            f"{r['gateway_cpu_pct']:>6.0f}% {per:>11.0f} {r['client_cpu_pct']:>6.0f}% "
            f"{r['streams_correct']:>4}/{r['streams']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--rates", default="5000,30000", help="offered events/s, comma-separated")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--chat", action="store_true", help="chat completions instead")
    ap.add_argument("--baseline", help="git ref whose gateway runs as 'before' rows")
    ap.add_argument("--no-libs-off", action="store_true", help="skip pure-Python-libs rows")
    ap.add_argument("--profile", help="py-spy each gateway into this directory")
    ap.add_argument("--quick", action="store_true", help="32 streams, 1+2 s, one rate")
    ap.add_argument("--out", default=str(
        ROOT / f"ops/bench/results/gateway-events-{socket.gethostname()}.json"))
    args = ap.parse_args()
    if args.quick:
        args.streams, args.warmup, args.seconds, args.rates = 32, 1.0, 2.0, "5000"
    tmp = Path(tempfile.mkdtemp(prefix="ferry-gwbench-"))
    rows = []
    for cfg in configs(args.baseline, tmp, not args.no_libs_off):
        for rate in (float(x) for x in args.rates.split(",")):
            raw = run_row(cfg, args.streams, rate, args.warmup, args.seconds, args.clients,
                          args.chat, tmp, profile=args.profile)
            rows.append(summarize(cfg, raw))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    result = {"host": socket.gethostname(), "cpus": os.cpu_count(), "streams": args.streams,
              "chat": args.chat, "seconds": args.seconds, "rows": rows}
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    mp.set_start_method("spawn", force=True)
    main()
