"""The gateway events bench in CI size: real ``ferry gateway``, real Redis, the synthetic
fenced-push publisher and the raw-socket SSE clients. It asserts what was delivered
(every event once, in order, then the finish chunk and ``[DONE]``), never a speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.bench.service.gateway_events import summarize
from ops.bench.service.gateway_procs import GatewayConfig, run_row

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_event_arrives_once_in_order(tmp_path: Path, chat: bool) -> None:
    cfg = GatewayConfig("this tree", ROOT)
    raw = run_row(cfg, streams=8, rate=400.0, warmup_s=0.2, measure_s=0.5, n_clients=2,
                  chat=chat, tmp=tmp_path, max_steps=30)
    row = summarize(cfg, raw)
    assert row["refused_pushes"] == 0
    assert row["events_per_stream"] > 0
    assert row["errors"] == []
    assert row["streams"] == 8 and row["streams_correct"] == 8, row
    clients = raw["clients"]
    assert sum(s["events"] for c in clients for s in c["streams"].values()) \
        == 8 * row["events_per_stream"]
