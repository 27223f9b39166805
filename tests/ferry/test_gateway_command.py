"""``ferry gateway``'s listen address: loopback unless ``--host`` says otherwise, a warning
when it listens beyond loopback without API keys, and deployments that say ``0.0.0.0``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.main import is_loopback, settings_env
from gateway.settings import GatewaySettings
from tests.ferry.gateway_proc import GatewayProcess, listen_addresses
from tests.ops import deploy_files
from tests.redis_server import RedisServer, free_port

WARNING = "gateway_open_without_api_keys"
LOOPBACK, ANY = "0100007F", "00000000"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def test_default_is_loopback_and_quiet(server: RedisServer) -> None:
    port = free_port()
    with GatewayProcess(server.url, port) as gw:
        gw.wait_healthy()
        assert listen_addresses(port) == {LOOPBACK}
        output = gw.stop()
    assert WARNING not in output


def test_every_interface_without_api_keys_warns(server: RedisServer) -> None:
    port = free_port()
    with GatewayProcess(server.url, port, "--host", "0.0.0.0") as gw:
        gw.wait_healthy()
        assert listen_addresses(port) == {ANY}
        output = gw.stop()
    line = next(ln for ln in output.splitlines() if WARNING in ln)
    assert '"level": "warning"' in line and "FERRY_API_KEYS" in line and "0.0.0.0" in line


def test_every_interface_with_api_keys_is_quiet(server: RedisServer) -> None:
    port = free_port()
    with GatewayProcess(server.url, port, FERRY_HOST="0.0.0.0", FERRY_API_KEYS="k1") as gw:
        gw.wait_healthy()  # FERRY_HOST works as well as --host
        assert listen_addresses(port) == {ANY}
        output = gw.stop()
    assert WARNING not in output


def test_deployments_listen_on_every_interface_explicitly() -> None:
    """The default changed to loopback: a container must say 0.0.0.0 or nobody reaches it."""
    gateways = [c for c in deploy_files.command_lines() if c.argv[1] == "gateway"]
    assert {c.source.split(":")[0] for c in gateways} >= {
        "docker-compose.yml", "gateway.yaml", "gateway.Dockerfile"}
    for line in gateways:
        assert deploy_files.setting(line, "--host") == "0.0.0.0", line


def test_is_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "gateway.internal"))


def test_settings_travel_to_gateway_workers_through_the_environment() -> None:
    """``--workers N`` children rebuild their settings from FERRY_* variables: all of them."""
    settings = GatewaySettings(api_keys=("a", "b"), max_queue_lag=None, prefix="other",
                               keepalive_s=2.5, max_tokens_limit=77)
    env = settings_env(settings)
    assert env["FERRY_API_KEYS"] == "a,b" and env["FERRY_MAX_QUEUE_LAG"] == "none"
    assert GatewaySettings.from_env(env) == settings
    with pytest.raises(ValueError, match="FERRY_\\* environment"):
        settings_env(GatewaySettings(api_keys=("a,b",)))


def test_allowed_origins_option_turns_cors_on(server: RedisServer) -> None:
    """``ferry gateway --allowed-origins a,b`` (vLLM's --allowed-origins): those origins
    get CORS answers, others none; and --workers processes get the same list."""
    import httpx

    port = free_port()
    origins = "https://a.example,https://b.example"
    with GatewayProcess(server.url, port, "--allowed-origins", origins, "--workers", "2") as gw:
        gw.wait_healthy()
        for _ in range(6):  # fresh connections: both processes answer some of them
            with httpx.Client() as client:
                ok = client.options(f"http://127.0.0.1:{port}/v1/models", headers={
                    "Origin": "https://b.example", "Access-Control-Request-Method": "GET"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == \
                "https://b.example"
        other = httpx.get(f"http://127.0.0.1:{port}/healthz",
                          headers={"Origin": "https://c.example"})
        assert "access-control-allow-origin" not in other.headers
        gw.stop()
