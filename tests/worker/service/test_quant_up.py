"""Quantized models through ``ferry up`` (a real gateway, worker and redis-server): an AWQ
checkpoint built at test time serves as it is, and ``--quantization int8`` quantizes a float
checkpoint in the workers it starts; each completion's text is the in-process engine's on
the same settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.sampling import SamplingParams
from tests.redis_server import free_port
from tests.worker.engine.runner.quant.agreement import build_moe
from tests.worker.engine.runner.quant.quantizers import write_quantized
from tests.worker.service.test_up_supervision import UpProcess

PROMPT = "def add(a, b):"


@pytest.mark.parametrize(("fmt", "flag", "moe"), [("awq", None, False), (None, "int8", False),
                                                  ("ct-fp8-channel", None, True)])
def test_ferry_up_serves_a_quantized_model(redis_server: Any, checkpoint: str, log_dir: Path,
                                           tmp_path: Path, fmt: str | None,
                                           flag: str | None, moe: bool) -> None:
    import torch

    from worker import LLM

    src = build_moe(tmp_path) if moe else checkpoint
    model = write_quantized(src, fmt, tmp_path)[0] if fmt else src
    options = {"quantization": flag} if flag else {}
    torch.set_num_threads(1)  # as the worker runs
    want = LLM(model, device="cpu", kv_cache_blocks=64, **options).generate(
        [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    port = free_port()
    args = ["--model", model, "--redis-url", redis_server.url, "--port", str(port),
            "--batchers", "0", "--metrics-port", "0", *(["--quantization", flag] if flag else [])]
    up = UpProcess(*args, log=log_dir / "up.log")
    try:
        up.wait_for(r"Ferry is up", timeout=120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            reply = http.post("/v1/completions", json={
                "model": Path(model).name, "prompt": PROMPT, "max_tokens": 8,
                "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want.choices[0].text
    finally:
        code = up.stop()
    assert code == 0, up.tail()
    if flag:  # the worker said what it did
        assert f'"method": "{flag}"' in (log_dir / "up.log").read_text()
    if moe:  # both MoE layers' experts loaded quantized
        assert '"moe_layers": 2' in (log_dir / "up.log").read_text()
