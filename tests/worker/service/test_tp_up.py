"""``ferry up --tensor-parallel-size 2`` (a real gateway, redis-server and a worker of two
ranks on gloo): seeded completions through the gateway are the one-process engine's; and
``ferry worker`` refuses, before loading, a size the model's heads do not split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from typer.testing import CliRunner

from ferry.cli import app
from protocol.sampling import SamplingParams
from tests.redis_server import free_port
from tests.worker.service.test_up_supervision import UpProcess

PROMPTS = ["def add(a, b):", "The quick brown fox"]


def test_ferry_up_tp2_streams_equal_one_process(redis_server: Any, checkpoint: str,
                                                 log_dir: Path) -> None:
    import torch

    from worker import LLM

    torch.set_num_threads(1)
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=5 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    llm = LLM(checkpoint, device="cpu", kv_cache_blocks=256)
    want = [out.text for out in llm.generate(PROMPTS, params)]
    port = free_port()
    up = UpProcess("--model", checkpoint, "--redis-url", redis_server.url, "--port",
                   str(port), "--batchers", "0", "--metrics-port", "0",
                   "--tensor-parallel-size", "2", log=log_dir / "up.log")
    try:
        up.wait_for(r"Ferry is up", timeout=180)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for prompt, p, text in zip(PROMPTS, params, want, strict=True):
                reply = http.post("/v1/completions", json={
                    "model": Path(checkpoint).name, "prompt": prompt, "stream": False,
                    "max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed,
                    "ignore_eos": True})
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == text
    finally:
        code = up.stop()
    assert code == 0, up.tail()
    assert "tensor_parallel_started" in (log_dir / "up.log").read_text()


def test_worker_refuses_heads_that_do_not_split_naming_both(checkpoint: str) -> None:
    result = CliRunner().invoke(app, ["worker", "--model", checkpoint, "--device", "cpu",
                                      "--tensor-parallel-size", "3"])
    assert result.exit_code != 0
    assert "tensor-parallel size 3" in result.output
    assert "attention heads" in result.output


def test_worker_refuses_more_ranks_than_cuda_devices_naming_both(checkpoint: str) -> None:
    import torch

    visible = torch.cuda.device_count()
    size = max(2, visible + 1)
    result = CliRunner().invoke(app, ["worker", "--model", checkpoint, "--device", "cuda",
                                      "--tensor-parallel-size", str(size)])
    assert result.exit_code != 0
    assert f"tensor-parallel size {size}" in result.output
    assert f"{visible} visible CUDA device" in result.output
