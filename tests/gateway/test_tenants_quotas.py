"""Tenant quotas across two gateways sharing one Redis, and the tenants file's bad inputs.

Two gateway apps (each its own uvicorn server, sharing nothing but the redis-server)
read one tenants file: a quota counted by one is seen by the other. No worker runs, so
admitted jobs stay queued until they are cancelled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import TenantDirectory
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANTS = f"""
[tenants.small]
keys_sha256 = ["{_sha('small-key')}"]
weight = 1
max_concurrent = 2
max_priority = 0

[tenants.metered]
keys_sha256 = ["{_sha('metered-key')}", "{_sha('metered-key-2')}"]
weight = 2.5
tokens_per_minute = 100
"""
SMALL = {"Authorization": "Bearer small-key"}
METERED = {"Authorization": "Bearer metered-key"}


@pytest.fixture(scope="module")
def gateways(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[GatewayServer, GatewayServer]]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    settings = GatewaySettings(redis_url=redis_server.url, tenants_file=str(path),
                               max_queue_lag=None)
    with GatewayServer(settings) as one, GatewayServer(settings) as two:
        yield one, two


def _submit(gw: GatewayServer, who: dict[str, str], rid: str, **extra: object
            ) -> httpx.Response:
    body = {"request_id": rid, "prompt": "hi", "params": {"max_tokens": 4}, **extra}
    return httpx.post(f"{gw.url}/v1/jobs", headers=who, json=body)


def _refused(reply: httpx.Response, quota: str) -> None:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert error["code"] == f"quota_{quota}" and f"quota {quota}" in error["message"]
    assert int(reply.headers["Retry-After"]) >= 1


def test_concurrency_is_shared_by_every_gateway_and_freed_by_a_cancel(
        gateways: tuple[GatewayServer, GatewayServer]) -> None:
    one, two = gateways
    assert _submit(one, SMALL, "c1").status_code == 202
    assert _submit(two, SMALL, "c2").status_code == 202
    _refused(_submit(two, SMALL, "c3"), "max_concurrent")
    _refused(_submit(one, SMALL, "c3"), "max_concurrent")
    assert httpx.delete(f"{two.url}/v1/jobs/c1", headers=SMALL).status_code == 202
    assert _submit(one, SMALL, "c3").status_code == 202  # the cancelled job's slot
    assert httpx.get(f"{one.url}/v1/jobs/c3", headers=METERED).status_code == 404
    metrics = httpx.get(f"{two.url}/metrics").text
    assert ('ferry_gateway_tenant_quota_rejections_total{quota="max_concurrent",'
            'tenant="small"} 1.0') in metrics


def test_highest_priority_allowed(gateways: tuple[GatewayServer, GatewayServer]) -> None:
    one, _two = gateways
    _refused(_submit(one, SMALL, "p1", priority=-1), "max_priority")
    # the refusal counted nothing: the tenant still has its one free slot
    assert httpx.delete(f"{one.url}/v1/jobs/c2", headers=SMALL).status_code == 202
    assert _submit(one, SMALL, "p2", priority=0).status_code == 202


def test_tokens_per_minute_across_gateways(gateways: tuple[GatewayServer, GatewayServer]
                                           ) -> None:
    """Each request's budget is its prompt (about 4 characters a token) and max_tokens:
    60 + 1 fits in 100; a second 61 does not, on either gateway, nor with its other key."""
    one, two = gateways
    assert _submit(one, METERED, "t1", params={"max_tokens": 60}).status_code == 202
    reply = _submit(two, METERED, "t2", params={"max_tokens": 60})
    _refused(reply, "tokens_per_minute")
    assert int(reply.headers["Retry-After"]) <= 61
    other_key = {"Authorization": "Bearer metered-key-2"}
    _refused(_submit(one, other_key, "t2", params={"max_tokens": 60}), "tokens_per_minute")
    assert _submit(two, METERED, "t3", params={"max_tokens": 10}).status_code == 202


@pytest.mark.parametrize(("text", "names"), [
    ("", "at least one"),
    ("tenants = 3", "at least one"),
    ("[tenants.a]\nweight = 1", "tenants.a.keys_sha256"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = 0', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = "3"', "tenants.a.weight"),
    ('[tenants.a]\nkeys_sha256 = ["not-a-hash"]', "tenants.a.keys_sha256"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nmax_concurrent = 0',
     "tenants.a.max_concurrent"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\ntokens_per_minute = 1.5',
     "tenants.a.tokens_per_minute"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nmax_priority = "high"',
     "tenants.a.max_priority"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nquota = 1', "unknown field(s) quota"),
    (f'[tenants."a b"]\nkeys_sha256 = ["{_sha("k")}"]', "tenants.a b"),
    (f'[tenants.default]\nkeys_sha256 = ["{_sha("k")}"]', "tenants.default"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\n[tenants.b]\nkeys_sha256 = '
     f'["{_sha("k")}"]', "two tenants"),
    ("[tenants.a\n", "cannot read"),
])
def test_bad_tenants_files_name_what_is_wrong(tmp_path: Path, text: str, names: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="tenants_file") as info:
        TenantDirectory.from_file(path)
    assert names in str(info.value)


def test_the_file_holds_hashes_and_both_settings_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(TENANTS)
    directory = TenantDirectory.from_file(path)
    assert "small-key" not in path.read_text()
    small = directory.resolve("small-key")
    assert small is not None and small.id == "small" and small.max_concurrent == 2
    assert directory.resolve("metered-key-2") == directory.resolve("metered-key")
    assert directory.resolve("nope") is None and directory.resolve("") is None
    from gateway.app import create_app
    with pytest.raises(ValueError, match="not both"):
        create_app(GatewaySettings(api_keys=("k",), tenants_file=str(path)))
    with pytest.raises(ValueError, match="cannot read"):
        create_app(GatewaySettings(tenants_file=str(tmp_path / "missing.toml")))
