"""LoRA adapters belong to whoever registered them: two tenants with their own keys, an
operator key, a real gateway and a real Redis, the scripted fake worker and a fake
``check_lora`` responder (the worker's own checks: tests/worker/service).

A tenant's adapters are its own namespace: another tenant neither sees, uses, unloads,
replaces nor squats them (every such try is answered exactly like a missing adapter), and
requests carry the registry key while callers see their plain name. Fleet-wide adapters
come from operators only, and a tenant's allowlist admits the fleet-wide ones it lists;
admission enforces both from the registry, with or without a live worker, in the jobs and
Batch APIs too. No answer shows a server path; names, paths and each namespace's count
are bounded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.lora.paths import NOT_ALLOWED
from protocol.lora.registry import LoraRecord, read_adapters, register_adapter
from tests.gateway.batcher_thread import BatcherThread
from tests.gateway.lora_fakes import LoraChecker
from tests.gateway.server import GatewayServer
from tests.gateway.test_batches_api import line, results, submit, wait
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
BASE = "base-model"
KEY = {t: f"key-{t}" for t in ("alpha", "beta", "gamma", "boss")}
OPERATOR = "key-operator"  # FERRY_ADMIN_KEYS
TENANTS = """
[tenants.alpha]
keys_sha256 = ["{alpha}"]
[tenants.beta]
keys_sha256 = ["{beta}"]
[tenants.gamma]
keys_sha256 = ["{gamma}"]
lora_adapters = ["shared"]
[tenants.boss]
keys_sha256 = ["{boss}"]
admin = true
"""


def _h(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY.get(who, who)}"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("ownership")
    found = {"root": top / "lora", "one": top / "lora/one", "two": top / "lora/two",
             "outside": top / "outside/three"}
    for name in ("one", "two", "outside"):
        found[name].mkdir(parents=True)
    return found


def _settings(url: str, tmp: Path, **more: Any) -> GatewaySettings:
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS.format(**{t: hashlib.sha256(k.encode()).hexdigest()
                                         for t, k in KEY.items()}))
    return GatewaySettings(**{"redis_url": url, "tenants_file": str(tenants),
                              "admin_keys": (OPERATOR,), "tokenizer_timeout_s": 3,
                              "batch_poll_interval_s": 0.05, "batch_lease_s": 2.0, **more})


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory,
            paths: dict[str, Path]) -> Iterator[GatewayServer]:
    settings = _settings(redis_server.url, tmp_path_factory.mktemp("gw"),
                         served_model_name=BASE, lora_roots=(str(paths["root"]),),
                         lora_max_adapters_per_tenant=3, lora_max_fleet_adapters=4)
    with GatewayServer(settings) as server:
        yield server


@pytest.fixture
def fleet(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["o", "k"]), model=BASE) as worker, \
            LoraChecker(redis_server.url, BASE):
        yield worker


def _post(gw: GatewayServer, path: str, body: Any, who: str) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, headers=_h(who), timeout=15)


def _load(gw: GatewayServer, who: str, name: str, path: Path | str,
          **more: Any) -> httpx.Response:
    return _post(gw, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path),
                                               **more}, who)


def _unload(gw: GatewayServer, who: str, name: str) -> httpx.Response:
    return _post(gw, "/v1/unload_lora_adapter", {"lora_name": name}, who)


def _complete(gw: GatewayServer, who: str, model: str) -> httpx.Response:
    return _post(gw, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, who)


def _cards(gw: GatewayServer, who: str) -> dict[str, dict[str, Any]]:
    reply = httpx.get(f"{gw.url}/v1/models", headers=_h(who), timeout=15)
    return {c["id"]: c for c in reply.json()["data"]}


def _not_found(reply: httpx.Response) -> None:
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["code"] == "model_not_found", reply.text


def test_a_tenants_adapter_is_its_own(gateway: GatewayServer, fleet: FakeWorker,
                                      paths: dict[str, Path], redis_client: redis.Redis
                                      ) -> None:
    reply = _load(gateway, "alpha", "sql", paths["one"])
    assert reply.status_code == 200, reply.text
    assert str(paths["root"]) not in reply.text and reply.json()["id"] == "sql"
    record = read_adapters(redis_client, KEYS, BASE)["alpha::sql"]
    assert (record.owner, record.source, record.path) == ("alpha", "api", str(paths["one"]))
    card = _cards(gateway, "alpha")["sql"]
    assert (card["root"], card["parent"], card["owned_by"]) == ("sql", BASE, "alpha")
    assert "sql" not in _cards(gateway, "beta")  # not listed, not found, not usable
    _not_found(httpx.get(f"{gateway.url}/v1/models/sql", headers=_h("beta"), timeout=15))
    _not_found(_complete(gateway, "beta", "sql"))
    _not_found(_complete(gateway, "beta", "alpha::sql"))
    assert "alpha" not in _complete(gateway, "beta", "sql").text
    _not_found(_unload(gateway, "beta", "sql"))  # nor unloaded by another
    _not_found(_unload(gateway, "beta", "alpha::sql"))

    reply = _complete(gateway, "alpha", "sql")
    assert reply.status_code == 200 and reply.json()["model"] == "sql", reply.text
    assert fleet.seen[-1].model == "alpha::sql"  # the registry key travels
    assert _load(gateway, "beta", "sql", paths["two"]).status_code == 200  # no squatting:
    assert _complete(gateway, "beta", "sql").status_code == 200  # beta's own, beside it
    assert fleet.seen[-1].model == "beta::sql"
    reply = _load(gateway, "beta", "sql", paths["one"], load_inplace=True)  # replace: own
    assert reply.status_code == 200, reply.text
    adapters = read_adapters(redis_client, KEYS, BASE)
    assert adapters["beta::sql"].path == str(paths["one"])
    assert adapters["alpha::sql"] == record  # untouched
    assert _unload(gateway, "alpha", "sql").status_code == 200
    assert set(read_adapters(redis_client, KEYS, BASE)) == {"beta::sql"}


def test_fleet_wide_adapters_come_from_operators(gateway: GatewayServer, fleet: FakeWorker,
                                                 paths: dict[str, Path],
                                                 redis_client: redis.Redis) -> None:
    """gamma may use the fleet-wide ``shared``: beta loading that name first gets its own,
    which gamma never sees; the operator's is the one gamma uses."""
    assert _load(gateway, "beta", "shared", paths["one"]).status_code == 200
    assert "shared" not in _cards(gateway, "gamma")
    _not_found(_complete(gateway, "gamma", "shared"))
    assert _load(gateway, OPERATOR, "shared", paths["two"]).status_code == 200
    assert _load(gateway, "boss", "other", paths["two"]).status_code == 200  # admin tenant
    adapters = read_adapters(redis_client, KEYS, BASE)
    assert adapters["shared"].owner is None and adapters["other"].owner is None
    assert adapters["beta::shared"].path == str(paths["one"])
    assert set(_cards(gateway, "gamma")) == {BASE, "shared"}  # its allowlist
    assert set(_cards(gateway, "alpha")) == {BASE, "shared", "other"}
    assert _complete(gateway, "gamma", "shared").status_code == 200
    assert fleet.seen[-1].model == "shared"
    assert _complete(gateway, "beta", "shared").status_code == 200
    assert fleet.seen[-1].model == "beta::shared"  # its own comes first
    _not_found(_complete(gateway, "gamma", "other"))
    _not_found(_unload(gateway, "alpha", "other"))  # a tenant unloads no fleet adapter
    reply = _load(gateway, "gamma", "mine", paths["one"])  # allowlist: none of its own
    assert reply.status_code == 403, reply.text
    assert _complete(gateway, OPERATOR, BASE).status_code == 401  # an admin key is no tenant
    assert _unload(gateway, OPERATOR, "beta::shared").status_code == 200  # operators: any
    assert _unload(gateway, OPERATOR, "other").status_code == 200
    assert set(read_adapters(redis_client, KEYS, BASE)) == {"shared"}


def test_names_paths_and_counts_are_bounded(gateway: GatewayServer, fleet: FakeWorker,
                                            paths: dict[str, Path],
                                            redis_client: redis.Redis) -> None:
    for name in ("x" * 65, "a::b", ".."):
        reply = _load(gateway, "alpha", name, paths["one"])
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_name"
    for path in (paths["outside"], f"{paths['root']}/../outside/three", "/etc", "relative",
                 "/" + "p" * 1030):
        reply = _load(gateway, "alpha", "p", path)
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert error["param"] == "lora_path" and str(path) not in reply.text
        if len(str(path)) <= 1024:
            assert error["message"] == NOT_ALLOWED
    for i in range(3):
        assert _load(gateway, "alpha", f"a{i}", paths["one"]).status_code == 200
    reply = _load(gateway, "alpha", "a3", paths["one"])
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "lora_adapter_limit"
    assert _load(gateway, "beta", "b0", paths["one"]).status_code == 200  # its own count
    reply = _complete(gateway, "beta", "nope")
    assert reply.status_code == 404 and "a0" not in reply.text and "b0" not in reply.text
    for i in range(4):
        assert _load(gateway, OPERATOR, f"f{i}", paths["one"]).status_code == 200
    assert _load(gateway, OPERATOR, "f4", paths["one"]).status_code == 403
    assert _unload(gateway, "alpha", "a0").status_code == 200
    assert _load(gateway, "alpha", "a3", paths["one"]).status_code == 200


def test_admission_enforces_ownership_with_no_worker_live(
        redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path) -> None:
    """No model configured and no worker live: the gateway still finds the registry (its
    list of models) and refuses what a tenant may not use; what it accepts carries the
    registry key. A name that is nothing at all waits for a worker, as before."""
    for name, owner in (("alpha::sql", "alpha"), ("other", None), ("shared", None)):
        register_adapter(redis_client, KEYS, LoraRecord(name=name, path="/lora/x",
                                                        parent=BASE, owner=owner))
    with GatewayServer(_settings(redis_server.url, tmp_path)) as gw:
        def job(who: str, model: str) -> httpx.Response:
            return _post(gw, "/v1/jobs", {"prompt": "hi", "model": model,
                                          "params": {"max_tokens": 2}}, who)

        _not_found(job("gamma", "other"))  # outside its allowlist
        _not_found(job("beta", "alpha::sql"))
        accepted = {who: job(who, model) for who, model in (
            ("alpha", "sql"), ("gamma", "shared"), ("beta", "sql"))}
        assert all(r.status_code == 202 for r in accepted.values()), accepted
        stored = {who: redis_client.hget(KEYS.job(f"{who}::{r.json()['id']}"), "model")
                  for who, r in accepted.items()}
        assert stored == {"alpha": b"alpha::sql", "gamma": b"shared",
                          "beta": b"sql"}  # beta's "sql" is a label, never alpha's
        shown = httpx.get(f"{gw.url}/v1/jobs/{accepted['alpha'].json()['id']}",
                          headers=_h("alpha"), timeout=15).json()
        assert shown["model"] == "sql"
        _not_found(_post(gw, "/v1/completions", {"model": "other", "prompt": "hi",
                                                 "max_tokens": 2, "stream": True}, "gamma"))


def test_batch_lines_run_as_their_owner(redis_server: RedisServer, redis_client: redis.Redis,
                                        tmp_path: Path) -> None:
    for name, owner in (("alpha::sql", "alpha"), ("other", None)):
        register_adapter(redis_client, KEYS, LoraRecord(name=name, path="/lora/x",
                                                        parent=BASE, owner=owner))
    settings = _settings(redis_server.url, tmp_path, served_model_name=BASE)
    body = {"prompt": "hi", "max_tokens": 2}
    with GatewayServer(settings) as gw, BatcherThread(settings, "b1"), \
            FakeWorker(redis_server.url, Script(tokens=["o", "k"]), model=BASE) as worker:
        def client(who: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY[who], max_retries=0)

        gamma, alpha = client("gamma"), client("alpha")
        done = wait(gamma, submit(gamma, [line("o", {**body, "model": "other"}),
                                          line("s", {**body, "model": "sql"}),
                                          line("b", {**body, "model": BASE})]).id)
        err = results(gamma, done.error_file_id)
        assert {k: v["response"]["status_code"] for k, v in err.items()} == {"o": 404,
                                                                             "s": 404}
        assert err["o"]["response"]["body"]["error"]["code"] == "model_not_found"
        done = wait(alpha, submit(alpha, [line("s", {**body, "model": "sql"})]).id)
        out = results(alpha, done.output_file_id)
        assert out["s"]["response"]["body"]["model"] == "sql" and done.model == "sql"
        assert [r.model for r in worker.seen if r.tenant == "alpha"] == ["alpha::sql"]
