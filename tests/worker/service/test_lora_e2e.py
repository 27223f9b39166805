"""Multi-LoRA end to end: a real ``ferry gateway`` and real ``ferry worker``
processes on a private redis-server, adapters written as PEFT files at test time.

What an operator sees: ``ferry worker --lora NAME=PATH`` serves that adapter from the
start; ``POST /v1/load_lora_adapter`` checks an adapter on a worker and registers it
fleet-wide, so ``/v1/models`` lists it and a request naming it gets the same tokens as the
in-process ``LLM(lora_modules=...)``; a bad adapter (another base model, a corrupt weights
file, a rank over the limit) is a 400 that says why, and the base model keeps serving; a
worker started after the load serves the adapter too, alone once the first one stops;
unloading while a request streams on the adapter lets that stream finish on it, and the
next request naming it gets 404. ``ferry up --lora NAME=PATH`` has its workers serve it.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.sampling import SamplingParams
from tests.ferry.gateway_proc import GatewayProcess
from tests.redis_server import free_port
from tests.worker.engine.lora_adapters import write_adapter
from tests.worker.service.procs import WorkerProcess
from tests.worker.service.test_up_supervision import UpProcess
from worker.engine.lora.targets import BaseTargets, TargetShape, base_targets

PROMPT = "def add(a, b):"
SHORT, LONG = 8, 300  # tokens; LONG streams while the adapter is unloaded
BASE = "llama"  # the checkpoint directory's name: the served model's
BAD = {  # adapter -> what the 400 must say
    "other-base": "an adapter for another base model",
    "corrupt": "is corrupt or unreadable",
    "too-big": "max_lora_rank=16",
}


@pytest.fixture(scope="module")
def adapters(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two good rank-8 adapters, and the three bad ones of ``BAD``."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-e2e")
    base = base_targets(AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint)
    paths = {name: write_adapter(root / name, base, rank=8, seed=seed, std=0.3)
             for seed, name in enumerate(["sql", "support", "corrupt"], start=31)}
    (Path(paths["corrupt"]) / "adapter_model.safetensors").write_bytes(b"\x07garbage" * 64)
    wider = BaseTargets("other/base-2x", {m: TargetShape(s.in_features * 2, s.out_features * 2)
                                          for m, s in base.shapes.items()})
    paths["other-base"] = write_adapter(root / "other-base", wider, rank=8, seed=5)
    paths["too-big"] = write_adapter(root / "too-big", base, rank=32, seed=6)
    return paths


@pytest.fixture(scope="module")
def want(checkpoint: str, adapters: dict[str, str]) -> dict[str, str]:
    """The in-process engine's texts: the base model's, each adapter's, and the long one."""
    import torch

    from worker import LLM

    torch.set_num_threads(1)
    llm = LLM(checkpoint, device="cpu", kv_cache_blocks=64, max_lora_rank=16,
              lora_modules=[f"{n}={adapters[n]}" for n in ("sql", "support")])
    short, long = (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                   for n in (SHORT, LONG))
    outs = llm.generate([PROMPT] * 4, [short, short, short, long],
                        lora_name=[None, "sql", "support", "sql"])
    texts = dict(zip(["base", "sql", "support", "sql-long"],
                     (out.choices[0].text for out in outs), strict=True))
    assert len({texts["base"], texts["sql"], texts["support"]}) == 3  # adapters matter
    return texts


def _body(model: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def _complete(http: httpx.Client, model: str) -> str:
    reply = http.post("/v1/completions", json=_body(model, SHORT))
    assert reply.status_code == 200, reply.text
    text: str = reply.json()["choices"][0]["text"]
    return text


def _models(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def _load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def _wait(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _serves(worker: WorkerProcess, adapter: str) -> bool:
    beat = worker.heartbeat()
    return beat is not None and adapter in str(beat.stats.get("lora_adapters", "")).split(",")


def _load_and_serve(http: httpx.Client, adapters: dict[str, str], want: dict[str, str]
                    ) -> None:
    """The adapter given at start and one loaded through the API, listed and served."""
    _wait(lambda: "support" in _models(http), "the --lora adapter in /v1/models")
    reply = _load(http, "sql", adapters["sql"])
    assert reply.status_code == 200, reply.text
    assert reply.json()["message"] == "Success: LoRA adapter 'sql' added successfully."
    cards = _models(http)
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == "sql"
    assert adapters["sql"] not in reply.text and adapters["sql"] not in str(cards)
    assert cards["support"]["parent"] == BASE
    assert _complete(http, "sql") == want["sql"]
    assert _complete(http, "support") == want["support"]
    assert _complete(http, BASE) == want["base"]


def _refuse_bad_adapters(http: httpx.Client, adapters: dict[str, str], want: dict[str, str]
                         ) -> None:
    for name, reason in BAD.items():
        reply = _load(http, name, adapters[name])
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert reason in error["message"] and error["param"] == "lora_path", error
        assert adapters[name] not in reply.text  # the reason, never the path
    assert not set(BAD) & set(_models(http))  # nothing of them registered
    assert _complete(http, BASE) == want["base"]
    assert _complete(http, "sql") == want["sql"]


def _unload_while_streaming(http: httpx.Client, want: dict[str, str]) -> None:
    """The running stream ends normally on the adapter; the next request is a 404."""
    text, finish, unloaded = "", None, False
    with http.stream("POST", "/v1/completions", json=_body("sql", LONG, stream=True)) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            finish = choice.get("finish_reason") or finish
            if text and not unloaded:
                gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
                assert gone.status_code == 200, gone.text
                unloaded = True
    assert unloaded and finish == "length"
    assert text == want["sql-long"]
    reply = http.post("/v1/completions", json=_body("sql", SHORT))
    assert reply.status_code == 404, reply.text
    assert "sql" not in _models(http)


def test_lora_adapters_through_the_gateway_and_real_workers(
        redis_server: Any, redis_client: Any, checkpoint: str, log_dir: Path,
        adapters: dict[str, str], want: dict[str, str]) -> None:
    port = free_port()
    roots = {"FERRY_LORA_ROOTS": str(Path(adapters["sql"]).parent)}
    first = WorkerProcess(checkpoint, redis_server.url, "lora-a", log_dir,
                          "--lora", f"support={adapters['support']}",
                          env={"FERRY_MAX_LORA_RANK": "16", **roots})
    later = WorkerProcess(checkpoint, redis_server.url, "lora-b", log_dir,
                          env={"FERRY_ENABLE_LORA": "1", "FERRY_MAX_LORA_RANK": "16", **roots})
    try:
        with GatewayProcess(redis_server.url, port) as gw, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            first.start().wait_live()
            gw.wait_healthy()
            _load_and_serve(http, adapters, want)
            _refuse_bad_adapters(http, adapters, want)
            later.start().wait_live()  # after the load: it learns it from the registry
            _wait(lambda: _serves(later, "sql") and _serves(later, "support"),
                  "the later worker to load both adapters")
            first.send(signal.SIGTERM)
            assert first.wait(60) == 0, first.log_tail()
            assert _complete(http, "sql") == want["sql"]  # only the later worker is left
            _unload_while_streaming(http, want)
            _wait(lambda: not _serves(later, "sql"), "the worker to drop the adapter")
    finally:
        first.kill()
        later.kill()


def test_ferry_up_lora_serves_the_adapter(redis_server: Any, redis_client: Any,
                                          checkpoint: str, log_dir: Path,
                                          adapters: dict[str, str], want: dict[str, str]
                                          ) -> None:
    port = free_port()
    up = UpProcess("--model", checkpoint, "--redis-url", redis_server.url, "--port",
                   str(port), "--batchers", "0", "--metrics-port", "0", "--lora",
                   f"sql={adapters['sql']}", "--max-lora-rank", "16", "--lora-root",
                   str(Path(adapters["sql"]).parent), log=log_dir / "up.log")
    try:
        up.wait_for(r"Ferry is up", timeout=120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            _wait(lambda: "sql" in _models(http), "the --lora adapter in /v1/models")
            assert _models(http)["sql"]["parent"] == BASE
            assert _complete(http, "sql") == want["sql"]
            reply = _load(http, "too-big", adapters["too-big"])  # --max-lora-rank reached it
            assert reply.status_code == 400 and BAD["too-big"] in reply.text, reply.text
    finally:
        code = up.stop()
    assert code == 0, up.tail()  # the workers drained and stopped clean
