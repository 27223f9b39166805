"""API keys and what they must not reveal or switch off: tenant names that cannot be
derived from a key, ``/metrics`` behind its own key, blank keys and bad tenants refused.

Real gateways (uvicorn) on a real redis-server; the startup refusals run the real
``ferry gateway`` and ``ferry batcher`` commands.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from gateway.tenancy.naming import secret_key
from gateway.tenancy.tenants import key_tenant_id
from protocol.keys import Keys
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer, free_port
from tests.worker.service.procs import ROOT, ferry_env

KEYS = Keys()
WEAK, OTHER = "password", "123456"  # the first words of every word list
SCRAPE = {"Authorization": "Bearer scrape-key"}


def _keyed(redis_server: RedisServer, **extra: object) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, api_keys=(WEAK, OTHER),
                           max_queue_lag=None, **extra)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(_keyed(redis_server, metrics_key="scrape-key")) as server:
        yield server


def _job(gw: GatewayServer, key: str, rid: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                      json={"request_id": rid, "prompt": "p", "params": {"max_tokens": 2}})


def test_tenant_labels_cannot_be_derived_from_the_keys(
        gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The label was ``key-`` + 16 hex digits of the key's plain SHA-256: hashing a word
    list found a weak key. Now it is an HMAC under the deployment's secret, kept in Redis,
    so every gateway on that Redis (and a restarted one) names a key alike."""
    assert _job(gateway, WEAK, "w1").status_code == 202
    metrics = httpx.get(f"{gateway.url}/metrics", headers=SCRAPE, timeout=10).text
    unsalted = "key-" + hashlib.sha256(WEAK.encode()).hexdigest()[:16]
    assert unsalted not in metrics
    secret = redis_client.get(secret_key(KEYS))
    assert secret is not None and len(secret) == 64
    name = key_tenant_id(WEAK, secret)
    assert f'ferry_gateway_tenant_requests_total{{tenant="{name}"}} 1.0' in metrics
    assert name != key_tenant_id(OTHER, secret)
    with GatewayServer(_keyed(redis_server)) as later:  # another gateway, started later
        job = httpx.get(f"{later.url}/v1/jobs/w1", headers={"Authorization": f"Bearer {WEAK}"})
        assert job.status_code == 200, job.text  # the same tenant: its job is found
        theirs = httpx.get(f"{later.url}/v1/jobs/w1",
                           headers={"Authorization": f"Bearer {OTHER}"})
        assert theirs.status_code == 404  # and still not the other key's
    assert redis_client.get(secret_key(KEYS)) == secret


def test_gateways_agree_on_names_after_redis_is_emptied(redis_server: RedisServer,
                                                        redis_client: redis.Redis) -> None:
    """A gateway that kept its secret in memory through a Redis flush must not name a key
    apart from a gateway started afterwards (its jobs would 404 there, its quotas count
    twice): each request reads the stored secret, and writes its own only if none is."""
    with GatewayServer(_keyed(redis_server)) as first:
        assert _job(first, WEAK, "e1").status_code == 202
        redis_client.flushdb()
        with GatewayServer(_keyed(redis_server)) as second:
            assert _job(second, WEAK, "e2").status_code == 202  # stores a new secret
            assert _job(first, WEAK, "e3").status_code == 202  # adopts it
            for gw in (first, second):
                for rid in ("e2", "e3"):
                    reply = httpx.get(f"{gw.url}/v1/jobs/{rid}",
                                      headers={"Authorization": f"Bearer {WEAK}"})
                    assert reply.status_code == 200, (gw.url, rid, reply.text)


def test_metrics_need_the_metrics_key_not_a_tenants(gateway: GatewayServer,
                                                   redis_server: RedisServer) -> None:
    url = f"{gateway.url}/metrics"
    assert httpx.get(url).status_code == 401
    tenant = httpx.get(url, headers={"Authorization": f"Bearer {WEAK}"})
    assert tenant.status_code == 401 and tenant.json()["error"]["param"] == "authorization"
    assert httpx.get(url, headers=SCRAPE).status_code == 200
    with GatewayServer(_keyed(redis_server)) as no_metrics_key:
        refused = httpx.get(f"{no_metrics_key.url}/metrics",
                            headers={"Authorization": f"Bearer {WEAK}"})
        assert refused.status_code == 403 and "FERRY_METRICS_KEY" in refused.text
    open_settings = GatewaySettings(redis_url=redis_server.url, max_queue_lag=None)
    with GatewayServer(open_settings) as without_keys:  # an open API: open metrics
        assert httpx.get(f"{without_keys.url}/metrics").status_code == 200


@pytest.mark.parametrize("raw", [" , ,, ", ",", ",,,"])
def test_api_keys_that_name_no_key_are_refused(raw: str) -> None:
    """``FERRY_API_KEYS=" , ,, "`` named no key and so turned authentication off."""
    with pytest.raises(ValueError, match="api_keys: FERRY_API_KEYS=.* names no key"):
        GatewaySettings.from_env({"FERRY_API_KEYS": raw})


def test_api_keys_that_are_keys_are_kept() -> None:
    assert GatewaySettings.from_env({"FERRY_API_KEYS": ""}).api_keys == ()  # no auth
    assert GatewaySettings.from_env({"FERRY_API_KEYS": " a ,, b,"}).api_keys == ("a", "b")
    for bad in ("", " a"):  # keys no bearer header can carry
        with pytest.raises(ValidationError, match="api_keys"):
            GatewaySettings(api_keys=(bad,))


def _exits(command: str, **env: str) -> str:
    """Run ``ferry COMMAND`` and return its output; it must exit on its own, non-zero."""
    argv = [sys.executable, "-m", "ferry.cli", command, "--redis-url",
            f"redis://127.0.0.1:{free_port()}/0"]
    if command == "gateway":
        argv += ["--port", str(free_port())]
    done = subprocess.run(argv, cwd=ROOT, env=ferry_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0, done
    return done.stdout + done.stderr


def test_the_gateway_refuses_to_start_with_blank_api_keys() -> None:
    output = _exits("gateway", FERRY_API_KEYS=" , ,, ")
    assert "ferry gateway:" in output and "api_keys" in output and "Traceback" not in output


@pytest.mark.parametrize("command", ["gateway", "batcher"])
@pytest.mark.parametrize(("field", "bad"), [
    ("weight", "weight = 1e-320"), ("weight", "weight = inf"), ("name", "")])
def test_gateway_and_batcher_refuse_a_bad_tenants_file(tmp_path: Path, command: str,
                                                       field: str, bad: str) -> None:
    name = '"ops\\n"' if field == "name" else "ops"
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.{name}]\nkeys_sha256 = ["{"0" * 64}"]\n{bad}\n')
    output = _exits(command, FERRY_TENANTS_FILE=str(path))
    where = "tenants.'ops\\n'" if field == "name" else "tenants.ops.weight"
    assert f"ferry {command}:" in output and where in output, output
