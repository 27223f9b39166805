"""Bodies nested too deep are a 400, found before anything recurses over them.

``json.loads`` raises ``RecursionError`` near a thousand levels; the gateway answered such a
body with a 500 on every route that parses one. Now each answers 400
``invalid_request_error`` saying the body is nested too deep, through a real gateway and
Redis; a body at the limit is parsed as before, and the gateway keeps serving.
``nesting_depth`` itself is checked against a character-by-character walk of JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.body import MAX_DEPTH, OFFLOAD_BYTES, nesting_depth
from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer

ROUTES = {  # each route's body; the nested value goes where "@" is (a top-level field)
    "/v1/completions": {"prompt": "x", "stop": "@"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "stop": "@"},
    "/v1/jobs": {"prompt": "x", "params": "@"},
}


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as server:
        yield server


def _body(path: str, nested: str) -> str:
    return json.dumps(ROUTES[path]).replace('"@"', nested)


def _post(gw: GatewayServer, path: str, body: str) -> httpx.Response:
    return httpx.post(gw.url + path, content=body,
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("levels", [5_000, 50_000])  # inline, and on a thread (> 64 KiB)
@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_body_nested_too_deep_is_a_400(gateway: GatewayServer, path: str,
                                         levels: int) -> None:
    body = _body(path, "[" * levels + "]" * levels)
    assert (len(body) > OFFLOAD_BYTES) == (levels == 50_000)
    reply = _post(gateway, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert error["message"] == (f"body: nested too deep ({levels + 1} levels of arrays and "
                                f"objects; the limit is {MAX_DEPTH})")
    assert httpx.get(gateway.url + "/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_the_limit_is_the_bodys_depth(gateway: GatewayServer, path: str) -> None:
    """Brackets inside strings are text: a body exactly at the limit reaches the route's
    own checks (a list is no stop sequence, nor params); one level more is refused."""
    levels = MAX_DEPTH - 1  # "@" is a field of the body object
    at_limit = _body(path, "[" * levels + '"[[{{\\"[[[' + "[" * 99 + '"' + "]" * levels)
    assert _walk(at_limit) == MAX_DEPTH
    reply = _post(gateway, path, at_limit)
    assert reply.status_code == 400 and "nested" not in reply.json()["error"]["message"]
    over = _post(gateway, path, _body(path, "[" * (levels + 1) + "]" * (levels + 1)))
    assert over.status_code == 400
    assert over.json()["error"]["message"].startswith(
        f"body: nested too deep ({MAX_DEPTH + 1} levels")


def _walk(text: str) -> int:
    """The deepest point of JSON text, one character at a time (the reference)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


_TEXT = st.text(alphabet=st.sampled_from(['[', ']', '{', '}', '"', "\\", "a", "\n", "é"]))
_JSON = st.recursive(st.none() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans(), st.integers(min_value=0, max_value=6))
def test_nesting_depth_is_the_depth_of_the_json(value: object, ascii_only: bool,
                                                at_most: int) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    found = nesting_depth(text.encode(), at_most)
    deepest = _walk(text)
    assert found == deepest if deepest > at_most else found <= at_most
