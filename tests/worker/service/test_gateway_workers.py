"""``ferry gateway --workers 2``: two processes answer on one port, and a completion works
through them (a real ``ferry worker`` behind, the official openai client in front)."""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from typing import Any

import openai

from protocol.sampling import SamplingParams
from tests.ferry.gateway_proc import GatewayProcess, children_of, listening_pids, server_of
from tests.redis_server import free_port
from tests.worker.service.procs import WorkerProcess


def _answering_pids(port: int, attempts: int, want: int) -> set[int]:
    """Open fresh connections and see which process accepted each (the kernel hands a
    shared listening socket's connections to whichever process accepts first)."""
    seen: set[int] = set()
    for _ in range(attempts):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
            assert conn.sock is not None
            seen |= server_of(port, conn.sock.getsockname()[1])
        finally:
            conn.close()
        if len(seen) >= want:
            break
        time.sleep(0.02)
    return seen


def test_two_gateway_processes_share_one_port(redis_server: Any, checkpoint: str,
                                              log_dir: Path, reference: Any) -> None:
    port = free_port()
    with WorkerProcess(checkpoint, redis_server.url, "gw-workers-1", log_dir) as worker, \
            GatewayProcess(redis_server.url, port, "--workers", "2") as gw:
        assert gw.proc is not None
        worker.wait_live()
        gw.wait_healthy()
        deadline = time.monotonic() + 60
        while len(servers := children_of(gw.proc.pid) & listening_pids(port)) < 2:
            assert time.monotonic() < deadline, servers  # uvicorn starts them one by one
            time.sleep(0.1)
        # uvicorn's parent (it bound the socket) and its two server processes hold it;
        # multiprocessing's resource tracker is a child too, but does not listen
        assert listening_pids(port) == servers | {gw.proc.pid}
        assert len(servers) == 2, servers
        answered = _answering_pids(port, attempts=300, want=2)
        assert answered == servers, (answered, servers)  # both answer, nobody else
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for i in range(2):
            chunks = client.completions.create(model=model, prompt=f"class Queue{i}:",
                                               max_tokens=8, temperature=0, stream=True)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            _ids, expected = reference.run(f"class Queue{i}:",
                                           SamplingParams(max_tokens=8, temperature=0))
            assert text == expected
        gw.stop()
    assert gw.proc is None

