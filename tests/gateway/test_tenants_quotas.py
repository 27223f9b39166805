"""Tenant quotas across two gateways sharing one Redis, and the tenants file's bad inputs.

Two gateway apps (each its own uvicorn server, sharing nothing but the redis-server)
read one tenants file: a quota counted by one is seen by the other. No worker runs, so
admitted jobs stay queued until they are cancelled. A request over what is left now is a
429 with Retry-After; one no wait can admit (over the quota by itself) is a 403 naming
the parameter, which SDKs do not retry.
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

[tenants.capped]
keys_sha256 = ["{_sha('capped-key')}"]
tokens_per_minute = 2000

[tenants.pair]
keys_sha256 = ["{_sha('pair-key')}"]
max_concurrent = 2
"""
SMALL = {"Authorization": "Bearer small-key"}
METERED = {"Authorization": "Bearer metered-key"}
CAPPED = {"Authorization": "Bearer capped-key"}
PAIR = {"Authorization": "Bearer pair-key"}
SCRAPER = {"Authorization": "Bearer scrape-key"}


@pytest.fixture(scope="module")
def gateways(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[GatewayServer, GatewayServer]]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    settings = GatewaySettings(redis_url=redis_server.url, tenants_file=str(path),
                               max_queue_lag=None, served_model_name="m",
                               max_tokens_limit=50_000,
                               metrics_key="scrape-key")
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


def _never(reply: httpx.Response, quota: str, param: str) -> None:
    """Refused for good: 403, no Retry-After, the quota and the parameter named."""
    assert reply.status_code == 403, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        f"quota_{quota}", param, "permission_error")
    assert f"quota {quota}" in error["message"] and "retry-after" not in reply.headers


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
    metrics = httpx.get(f"{two.url}/metrics", headers=SCRAPER).text
    assert ('ferry_gateway_tenant_quota_rejections_total{quota="max_concurrent",'
            'tenant="small"} 1.0') in metrics


def test_highest_priority_allowed(gateways: tuple[GatewayServer, GatewayServer]) -> None:
    one, _two = gateways
    _never(_submit(one, SMALL, "p1", priority=-1), "max_priority", "priority")
    # the refusal counted nothing: the tenant still has its one free slot
    assert httpx.delete(f"{one.url}/v1/jobs/c2", headers=SMALL).status_code == 202
    assert _submit(one, SMALL, "p2", priority=0).status_code == 202


def test_more_prompts_than_max_concurrent_are_refused_for_good(
        gateways: tuple[GatewayServer, GatewayServer]) -> None:
    """Three prompts in one completion are three requests in flight at once: a tenant
    allowed two can never send it (it got a 429 and SDKs retried it forever)."""
    one, _two = gateways
    body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 2}
    reply = httpx.post(f"{one.url}/v1/completions", headers=PAIR, json=body, timeout=10)
    _never(reply, "max_concurrent", "prompt")


def test_a_duplicate_id_keeps_the_running_jobs_slot(
        gateways: tuple[GatewayServer, GatewayServer]) -> None:
    """A 409 for an id in use must not give back the slot: it is the running job's."""
    one, two = gateways
    assert _submit(one, PAIR, "d1").status_code == 202
    for gw in (one, two, one):
        assert _submit(gw, PAIR, "d1").status_code == 409
    assert _submit(two, PAIR, "d2").status_code == 202
    _refused(_submit(one, PAIR, "d3"), "max_concurrent")  # d1 and d2 are in flight


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


def test_a_request_over_tokens_per_minute_is_refused_for_good(
        gateways: tuple[GatewayServer, GatewayServer]) -> None:
    """42,000 tokens passed a 2,000/min quota as the first request of a minute; it can
    never fit, so it is a 403 naming max_tokens, first of its minute or not."""
    one, two = gateways
    reply = _submit(one, CAPPED, "big", params={"max_tokens": 42_000})
    _never(reply, "tokens_per_minute", "max_tokens")
    assert "42001" in reply.json()["error"]["message"]
    _never(_submit(two, CAPPED, "big", params={"max_tokens": 2000}), "tokens_per_minute",
           "max_tokens")  # 2000 + the prompt's token
    assert _submit(two, CAPPED, "fits", params={"max_tokens": 1999}).status_code == 202


@pytest.mark.parametrize(("text", "names"), [
    ("", "at least one"),
    ("tenants = 3", "at least one"),
    ("[tenants.a]\nweight = 1", "tenants.a.keys_sha256"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = 0', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = "3"', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = 1e-320', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = inf', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = nan', "tenants.a.weight"),
    (f'[tenants.a]\nkeys_sha256 = ["{_sha("k")}"]\nweight = 1e6', "tenants.a.weight"),
    (f'[tenants."a\\n"]\nkeys_sha256 = ["{_sha("k")}"]', "tenants.'a\\n'"),
    (f'[tenants."a\\t"]\nkeys_sha256 = ["{_sha("k")}"]', "tenants.'a\\t'"),
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
