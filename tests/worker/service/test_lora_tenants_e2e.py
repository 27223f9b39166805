"""Two tenants, an operator, a real gateway, a real worker (in-process) and a real Redis:
LoRA adapters end to end as a hostile tenant meets them.

The gateway has no adapter roots of its own here, so every path reaches the worker, which
opens only directories inside its roots (resolved first) and refuses everything else with
the one sentence; each tenant's ``sql`` runs its own weights; another tenant's adapter is
not found; an operator's adapter serves everyone; no answer shows a path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import GatewaySettings
from protocol.lora.paths import NOT_ALLOWED
from protocol.sampling import SamplingParams
from tests.gateway.server import GatewayServer
from tests.worker.engine.lora_adapters import write_adapter
from tests.worker.service.conftest import make_engine
from tests.worker.service.test_service_inprocess import Running
from worker import LLM
from worker.engine.lora.targets import base_targets

PROMPT = "def add(a, b):"
A, B, OP = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b", "key-op"))


@pytest.fixture(scope="module")
def tree(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    top = tmp_path_factory.mktemp("lora-tenants")
    base = base_targets(AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint)
    root = top / "root"
    write_adapter(root / "sql", base, rank=8, seed=51, std=0.3)
    write_adapter(root / "support", base, rank=8, seed=52, std=0.3)
    write_adapter(top / "outside" / "stolen", base, rank=8, seed=53, std=0.3)
    (root / "a-file").write_text("x")
    (root / "link-out").symlink_to(top / "outside" / "stolen")
    return {"root": root, "outside": top / "outside"}


@pytest.fixture(scope="module")
def want(checkpoint: str, tree: dict[str, Path]) -> dict[str | None, str]:
    llm = LLM(checkpoint, device="cpu", kv_cache_blocks=64, max_lora_rank=16,
              lora_modules=[f"{n}={tree['root'] / n}" for n in ("sql", "support")])
    names: list[str | None] = [None, "sql", "support"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([PROMPT] * 3, params, lora_name=names)
    return {name: out.choices[0].text for name, out in zip(names, outs, strict=True)}


@pytest.fixture
def stack(redis_server: Any, redis_client: Any, checkpoint: str, tree: dict[str, Path]
          ) -> Iterator[httpx.Client]:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=("key-a", "key-b"),
                               admin_keys=("key-op",), served_model_name="ferry",
                               tokenizer_timeout_s=30)
    engine = make_engine(checkpoint, max_lora_rank=16, enable_lora=True)
    with Running(engine, redis_server.url, lora_roots=(str(tree["root"]),)), \
            GatewayServer(settings) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        yield http


def _load(http: httpx.Client, who: dict[str, str], name: str, path: Path | str
          ) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", headers=who,
                     json={"lora_name": name, "lora_path": str(path)})


def _text(http: httpx.Client, who: dict[str, str], model: str) -> str:
    reply = http.post("/v1/completions", headers=who, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model
    text: str = reply.json()["choices"][0]["text"]
    return text


def test_paths_outside_the_workers_roots_are_refused_alike(
        stack: httpx.Client, tree: dict[str, Path]) -> None:
    root, outside = tree["root"], tree["outside"]
    for path in (outside / "stolen", root / "missing", root / "a-file", root / "link-out",
                 f"{root}/../outside/stolen", "/proc/1/root", "/etc", "/root"):
        reply = _load(stack, A, "x", path)
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert (error["message"], error["param"]) == (NOT_ALLOWED, "lora_path"), path
    assert _load(stack, A, "x", root / "sql").status_code == 200


def test_each_tenants_adapter_runs_its_own_weights(
        stack: httpx.Client, tree: dict[str, Path], want: dict[str | None, str]) -> None:
    root = tree["root"]
    assert _load(stack, A, "sql", root / "sql").status_code == 200
    assert _text(stack, A, "sql") == want["sql"]
    reply = stack.post("/v1/completions", headers=B, json={"model": "sql", "prompt": PROMPT})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert _load(stack, B, "sql", root / "support").status_code == 200  # its own "sql"
    assert _text(stack, B, "sql") == want["support"]
    assert _text(stack, A, "sql") == want["sql"]  # a's is untouched
    gone = stack.post("/v1/unload_lora_adapter", headers=B, json={"lora_name": "sql"})
    assert gone.status_code == 200
    assert _text(stack, A, "sql") == want["sql"]
    assert _load(stack, OP, "shared", root / "support").status_code == 200
    assert _text(stack, A, "shared") == _text(stack, B, "shared") == want["support"]
    listed = stack.get("/v1/models", headers=B).json()
    assert [c["id"] for c in listed["data"]] == ["ferry", "shared"]
    assert str(root) not in str(listed)
