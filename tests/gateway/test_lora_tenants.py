"""A tenants file's ``lora_adapters`` allowlist: a tenant sees and uses only the fleet-wide
adapters it lists (others are 404 ``model_not_found``, as if they did not exist, also on
unload); a tenant without the field may use every fleet-wide adapter. A tenant with an
allowlist loads adapters of its own only when the file gives it ``max_lora_adapters``
(a load by path could read any adapter under the roots)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import TenantDirectory
from protocol.keys import Keys
from protocol.lora.registry import LoraRecord, register_adapter
from tests.gateway.lora_fakes import LoraChecker
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
BASE = "base-model"
ALPHA = {"Authorization": "Bearer key-alpha"}  # lora_adapters = ["shared-a", "own-a"]
BETA = {"Authorization": "Bearer key-beta"}  # no allowlist
GAMMA = {"Authorization": "Bearer key-gamma"}  # ["shared-a"], max_lora_adapters = 1


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapters") / "one"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayServer]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(
        f'[tenants.alpha]\nkeys_sha256 = ["{_sha("key-alpha")}"]\n'
        'lora_adapters = ["shared-a", "own-a"]\n'
        f'[tenants.beta]\nkeys_sha256 = ["{_sha("key-beta")}"]\n'
        f'[tenants.gamma]\nkeys_sha256 = ["{_sha("key-gamma")}"]\n'
        'lora_adapters = ["shared-a"]\nmax_lora_adapters = 1\n')
    settings = GatewaySettings(redis_url=redis_server.url, served_model_name=BASE,
                               tenants_file=str(tenants), tokenizer_timeout_s=3)
    with GatewayServer(settings) as server:
        yield server


@pytest.fixture
def fleet(redis_server: RedisServer, redis_client: redis.Redis, adapter_dir: Path
          ) -> Iterator[FakeWorker]:
    for name in ("shared-a", "secret-b"):
        register_adapter(redis_client, KEYS, LoraRecord(name=name, path=str(adapter_dir),
                                                        parent=BASE))
    with FakeWorker(redis_server.url, Script(tokens=["o", "k"]), model=BASE) as worker, \
            LoraChecker(redis_server.url, BASE):
        yield worker


def _post(gw: GatewayServer, path: str, body: Any, who: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, headers=who, timeout=15)


def _complete(gw: GatewayServer, model: str, who: dict[str, str]) -> httpx.Response:
    return _post(gw, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, who)


def _listed(gw: GatewayServer, who: dict[str, str]) -> list[str]:
    return [c["id"] for c in httpx.get(f"{gw.url}/v1/models", headers=who).json()["data"]]


def test_allowlist_limits_listing_and_use(gateway: GatewayServer, fleet: FakeWorker) -> None:
    assert _listed(gateway, ALPHA) == [BASE, "shared-a"]
    assert _listed(gateway, BETA) == [BASE, "secret-b", "shared-a"]
    assert httpx.get(f"{gateway.url}/v1/models/secret-b", headers=ALPHA).status_code == 404
    assert httpx.get(f"{gateway.url}/v1/models/secret-b", headers=BETA).status_code == 200

    assert _complete(gateway, "shared-a", ALPHA).status_code == 200
    assert _complete(gateway, BASE, ALPHA).status_code == 200
    reply = _complete(gateway, "secret-b", ALPHA)
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and "secret-b'" not in error["message"].split(
        "served:")[1]
    assert _complete(gateway, "secret-b", BETA).status_code == 200
    assert fleet.seen[-1].model == "secret-b"


def test_allowlist_limits_load_and_unload(gateway: GatewayServer, fleet: FakeWorker,
                                          adapter_dir: Path) -> None:
    reply = _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "secret-b"}, ALPHA)
    assert reply.status_code == 404, reply.text
    load = {"lora_name": "other-c", "lora_path": str(adapter_dir)}
    for name in ("other-c", "own-a", "shared-a"):  # an allowlist and no max_lora_adapters
        reply = _post(gateway, "/v1/load_lora_adapter", load | {"lora_name": name}, ALPHA)
        assert reply.status_code == 403 and reply.json()["error"]["param"] == "lora_name"
    own = {"lora_name": "own-g", "lora_path": str(adapter_dir)}
    assert _post(gateway, "/v1/load_lora_adapter", own, GAMMA).status_code == 200
    assert _listed(gateway, GAMMA) == [BASE, "own-g", "shared-a"]
    assert "own-g" not in _listed(gateway, BETA)
    reply = _post(gateway, "/v1/load_lora_adapter", load, GAMMA)  # its one is taken
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"]["code"] == "lora_adapter_limit"
    assert _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "own-g"}, GAMMA
                 ).status_code == 200
    assert _post(gateway, "/v1/load_lora_adapter", load, BETA).status_code == 200
    assert httpx.post(f"{gateway.url}/v1/load_lora_adapter", json=load).status_code == 401


@pytest.mark.parametrize("value", ['"shared-a"', '["a/b"]', "[1]"])
def test_bad_allowlist_stops_the_file(tmp_path: Path, value: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.t]\nkeys_sha256 = ["{"0" * 64}"]\nlora_adapters = {value}\n')
    with pytest.raises(ValueError, match="tenants.t.lora_adapters"):
        TenantDirectory.from_file(path)


def test_empty_allowlist_allows_no_adapter(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.t]\nkeys_sha256 = ["{"0" * 64}"]\nlora_adapters = []\n')
    tenant = TenantDirectory.from_file(path).tenant("t")
    assert not tenant.may_use_adapter("any") and tenant.lora_adapters == frozenset()
