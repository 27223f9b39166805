"""A degraded worker is seen at a glance: error log, Prometheus gauge, heartbeat, ferry top.

The state tried for real here is the one a CPU can show: no C++ compiler (``CXX`` names
none), so the worker serves on the slower pure-torch attention. The GPU ones (graphs
unavailable or mismatched, a kernel that failed) travel the same way from
``EngineHealth``; their engine side is tested in ``tests/worker/engine``.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from rich.console import Console

from ferry.commands import top as top_cmd
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.redis_server import RedisServer, free_port
from tests.worker.service.procs import WorkerProcess, stream_all, tokens_of


def test_a_worker_without_a_compiler_says_it_is_degraded(
        checkpoint: str, log_dir: Path, reference: object) -> None:
    port = free_port()
    with RedisServer() as server, WorkerProcess(
            checkpoint, server.url, "no-cxx", log_dir, "--metrics-port", str(port),
            env={"CXX": "ferry-no-such-compiler"}) as worker:
        worker.wait_live()
        beat = worker.heartbeat()
        assert beat is not None
        assert beat.stats["degraded"] == "cpu_attention_fallback"
        assert beat.stats["decode_graphs"] == 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b'ferry_worker_degraded{reason="cpu_attention_fallback"} 1.0' in metrics
        assert b'ferry_worker_degraded{reason="decode_graphs_unavailable"} 0.0' in metrics
        client = server.client()
        console = Console(width=200, record=True, color_system=None)
        console.print(top_cmd.render(top_cmd.collect(client, Keys())))
        assert "DEGRADED cpu_attention_fallback" in console.export_text()
        request = GenerateRequest(prompt="The quick brown fox", params=SamplingParams(
            max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
        events = stream_all(server.url, [request])[request.request_id]
        expected = reference.llm.generate([request.prompt], [request.params])  # type: ignore[attr-defined]
        assert tokens_of(events) == expected[0].token_ids  # slower, still right
        client.close()
    lines = [json.loads(line) for line in worker.log_path.read_text().splitlines()
             if line.startswith("{")]
    assert [e["level"] for e in lines if e.get("event") == "cpu_attention_fallback"] == ["error"]
