"""LoRA adapters through the gateway, on a real uvicorn and a real Redis, with a fake
worker (completions) and a fake ``check_lora`` responder (tests/gateway/lora_fakes.py):
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, /v1/models' adapter cards,
requests naming an adapter, and the FERRY_LORA_DIR resolver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.lora.registry import LoraRecord, read_adapters, register_adapter
from tests.gateway.lora_fakes import CORRUPT, REFUSAL, LoraChecker
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
BASE = "base-model"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``adapters/`` for explicit loads, ``resolver/`` as FERRY_LORA_DIR."""
    root = tmp_path_factory.mktemp("lora")
    for sub in ("adapters/sql-v1", "adapters/chat-v2", "resolver/auto-a", "resolver/bad-b"):
        (root / sub).mkdir(parents=True)
    (root / "resolver/bad-b" / CORRUPT).write_text("x")
    return {"adapters": root / "adapters", "resolver": root / "resolver", "root": root}


@pytest.fixture
def fleet(redis_server: RedisServer, redis_client: redis.Redis
          ) -> Iterator[tuple[FakeWorker, LoraChecker]]:
    """Per test: ``redis_client`` empties the database first (groups, heartbeats)."""
    with FakeWorker(redis_server.url, Script(tokens=["o", "k"]), model=BASE) as worker, \
            LoraChecker(redis_server.url, BASE) as checker:
        yield worker, checker


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, dirs: dict[str, Path]) -> Iterator[GatewayServer]:
    settings = GatewaySettings(redis_url=redis_server.url, served_model_name=BASE,
                               tokenizer_timeout_s=3, lora_dir=str(dirs["resolver"]),
                               lora_roots=(str(dirs["root"]),))
    with GatewayServer(settings) as server:
        yield server


def _post(gw: GatewayServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=15)


def _error(reply: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = reply.json()["error"]
    return error


def _complete(gw: GatewayServer, model: str) -> httpx.Response:
    return _post(gw, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})


def _cards(gw: GatewayServer) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in httpx.get(f"{gw.url}/v1/models").json()["data"]}


def test_load_list_serve_unload(gateway: GatewayServer, dirs: dict[str, Path],
                                fleet: tuple[FakeWorker, LoraChecker],
                                redis_client: redis.Redis) -> None:
    worker, checker = fleet
    path = str(dirs["adapters"] / "sql-v1")
    reply = _post(gateway, "/v1/load_lora_adapter", {"lora_name": "sql-v1", "lora_path": path})
    assert reply.status_code == 200, reply.text
    assert reply.json()["message"] == "Success: LoRA adapter 'sql-v1' added successfully."
    assert path not in reply.text  # no answer shows a server path
    assert ("sql-v1", path) in checker.asked
    record = read_adapters(redis_client, KEYS, BASE)["sql-v1"]
    assert (record.path, record.parent) == (path, BASE)

    cards = _cards(gateway)
    assert cards[BASE]["parent"] is None and cards[BASE]["root"] == BASE
    assert cards["sql-v1"]["parent"] == BASE and cards["sql-v1"]["root"] == "sql-v1"
    assert list(cards)[0] == BASE
    one = httpx.get(f"{gateway.url}/v1/models/sql-v1").json()
    assert one == cards["sql-v1"]

    reply = _complete(gateway, "sql-v1")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "sql-v1"
    assert worker.seen[-1].model == "sql-v1"  # the job names the adapter; the worker maps it

    reply = _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "sql-v1",
                                                       "lora_int_id": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["message"] == "Success: LoRA adapter 'sql-v1' removed successfully."
    assert "sql-v1" not in read_adapters(redis_client, KEYS, BASE)
    assert "sql-v1" not in _cards(gateway)
    reply = _complete(gateway, "sql-v1")
    assert reply.status_code == 404 and _error(reply)["code"] == "model_not_found"
    reply = _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "sql-v1"})
    assert reply.status_code == 404 and _error(reply)["param"] == "lora_name"


def test_load_refusals(gateway: GatewayServer, dirs: dict[str, Path],
                       fleet: tuple[FakeWorker, LoraChecker],
                       redis_client: redis.Redis) -> None:
    _, checker = fleet
    good = str(dirs["adapters"] / "chat-v2")
    cases = [
        ({"lora_name": "a/b", "lora_path": good}, "lora_name", "must match"),
        ({"lora_name": "..", "lora_path": good}, "lora_name", "must match"),
        ({"lora_name": "x" * 129, "lora_path": good}, "lora_name", "must match"),
        ({"lora_name": BASE, "lora_path": good}, "lora_name", "served base model"),
        ({"lora_name": "chat-v2"}, "lora_path", ""),
        ({"lora_name": 7, "lora_path": good}, "lora_name", ""),
    ]
    asked = len(checker.asked)
    for body, param, words in cases:
        reply = _post(gateway, "/v1/load_lora_adapter", body)
        assert reply.status_code == 400, (body, reply.text)
        assert _error(reply)["param"] == param and words in _error(reply)["message"], body
    assert len(checker.asked) == asked  # refused before any worker was asked

    missing = str(dirs["adapters"] / "missing")
    reply = _post(gateway, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": missing})
    assert reply.status_code == 400, reply.text
    assert _error(reply)["message"] == REFUSAL and _error(reply)["param"] == "lora_path"
    assert "gone" not in read_adapters(redis_client, KEYS, BASE)

    body = {"lora_name": "chat-v2", "lora_path": good}
    assert _post(gateway, "/v1/load_lora_adapter", body).status_code == 200
    reply = _post(gateway, "/v1/load_lora_adapter", body)
    assert reply.status_code == 400 and "already been loaded" in _error(reply)["message"]
    assert _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "chat-v2"}
                 ).status_code == 200


def test_unload_unknown_is_404(gateway: GatewayServer,
                               fleet: tuple[FakeWorker, LoraChecker]) -> None:
    reply = _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert reply.status_code == 404, reply.text
    assert _error(reply)["code"] == "model_not_found"
    assert _post(gateway, "/v1/unload_lora_adapter", {}).status_code == 400


def test_adapter_registered_elsewhere_is_served_at_once(
        gateway: GatewayServer, dirs: dict[str, Path], redis_client: redis.Redis,
        fleet: tuple[FakeWorker, LoraChecker]) -> None:
    """Another gateway (or a worker's FERRY_LORA_MODULES) registered it: the cached miss
    is re-read before a 404."""
    assert _complete(gateway, "BASE").status_code == 404  # fills the cache
    path = str(dirs["adapters"] / "sql-v1")
    assert register_adapter(redis_client, KEYS, LoraRecord(name="elsewhere", path=path,
                                                           parent=BASE))
    try:
        reply = _complete(gateway, "elsewhere")
        assert reply.status_code == 200, reply.text
    finally:
        redis_client.hdel(KEYS.lora_adapters(BASE), "elsewhere")


def test_tokenize_an_adapter_asks_its_base_model(
        gateway: GatewayServer, redis_client: redis.Redis, dirs: dict[str, Path],
        fleet: tuple[FakeWorker, LoraChecker]) -> None:
    path = str(dirs["adapters"] / "sql-v1")
    register_adapter(redis_client, KEYS, LoraRecord(name="tok-a", path=path, parent=BASE))
    try:  # the fake answers only check_lora: its refusal shows the base model's list
        reply = _post(gateway, "/tokenize", {"model": "tok-a", "prompt": "hi"})
        assert reply.status_code == 400 and "not faked" in _error(reply)["message"]
    finally:
        redis_client.hdel(KEYS.lora_adapters(BASE), "tok-a")


def test_lora_dir_resolver(gateway: GatewayServer, dirs: dict[str, Path],
                           fleet: tuple[FakeWorker, LoraChecker],
                           redis_client: redis.Redis) -> None:
    worker, checker = fleet
    reply = _complete(gateway, "auto-a")
    assert reply.status_code == 200, reply.text
    assert worker.seen[-1].model == "auto-a"
    path = str(dirs["resolver"] / "auto-a")
    assert read_adapters(redis_client, KEYS, BASE)["auto-a"].path == path
    assert _cards(gateway)["auto-a"]["root"] == "auto-a"
    assert _complete(gateway, "auto-a").status_code == 200
    assert checker.asked.count(("auto-a", path)) == 1  # loaded once, then served

    reply = _complete(gateway, "bad-b")  # there, but the worker refuses it
    assert reply.status_code == 400 and "corrupt" in _error(reply)["message"]
    assert _error(reply)["param"] == "model"
    asked = len(checker.asked)
    for name in ("not-there", "..", "."):
        reply = _complete(gateway, name)
        assert reply.status_code == 404 and _error(reply)["code"] == "model_not_found"
    assert len(checker.asked) == asked
    assert _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "auto-a"}
                 ).status_code == 200


def test_no_worker_of_the_base_model_is_503(redis_server: RedisServer,
                                            fleet: tuple[FakeWorker, LoraChecker],
                                            dirs: dict[str, Path]) -> None:
    settings = GatewaySettings(redis_url=redis_server.url, served_model_name="ghost")
    with GatewayServer(settings) as gw:
        reply = _post(gw, "/v1/load_lora_adapter", {
            "lora_name": "orphan", "lora_path": str(dirs["adapters"] / "sql-v1")})
        assert reply.status_code == 503 and "retry-after" in reply.headers
