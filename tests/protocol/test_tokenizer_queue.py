"""The tokenizer calls' queue (``protocol/tokenizer_queue.py``) on a real redis-server: one
call per tenant in turn, small calls for the threads that take only those, bells, calls
taken back, TTLs on every key."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from protocol.keys import Keys
from protocol.tokenizer_queue import (
    BELL,
    POP_LUA,
    PUSH_LUA,
    SMALL_BYTES,
    TAKE_BACK_LUA,
    item,
    payload_of,
    pop_args,
    push_args,
    queue_key,
    ready_key,
    small_bell_key,
)

BASE = Keys().tokenizer_requests("org/model")
SMALL, LARGE = b"s" * 100, b"L" * (SMALL_BYTES + 1)


@pytest.fixture
def r(redis_client: redis.Redis) -> redis.Redis:
    redis_client.flushall()
    return redis_client


def _push(r: redis.Redis, tenant: str, payload: bytes) -> bytes:
    entry = item(payload + tenant.encode())
    keys, args = push_args(BASE, tenant, entry, 60)
    r.eval(PUSH_LUA, len(keys), *keys, *args)
    return entry


def _pop(r: redis.Redis, small_only: bool = False) -> str | None:
    keys, args = pop_args(BASE, small_only)
    raw: Any = r.eval(POP_LUA, len(keys), *keys, *args)
    return None if raw is None else payload_of(raw).decode()


def test_tenants_are_served_in_turn(r: redis.Redis) -> None:
    """a's flood came first, b and c joined later: one call per tenant in turn, each
    tenant's in its order."""
    for i in range(4):
        _push(r, "a", b"%d" % i)
    _push(r, "b", b"0")
    _push(r, "b", b"1")
    _push(r, "c", b"0")
    order = [_pop(r) for _ in range(7)]
    assert order == ["0a", "0b", "0c", "1a", "1b", "2a", "3a"]
    assert _pop(r) is None
    assert not r.exists(ready_key(BASE), queue_key(BASE, "a"))  # nothing left behind


def test_a_small_only_pop_skips_large_calls(r: redis.Redis) -> None:
    _push(r, "a", LARGE)
    _push(r, "b", SMALL)
    assert _pop(r, small_only=True) == SMALL.decode() + "b"
    assert _pop(r, small_only=True) is None  # a's call is large: for the other threads
    assert _pop(r) == LARGE.decode() + "a"


def test_bells_and_ttls(r: redis.Redis) -> None:
    """One bell per call, a small bell per small call; every key expires."""
    _push(r, "a", LARGE)
    _push(r, "b", SMALL)
    assert r.lrange(BASE, 0, -1) == [BELL, BELL]
    assert r.lrange(small_bell_key(BASE), 0, -1) == [BELL]
    for key in r.scan_iter("*"):
        assert 0 < r.ttl(key) <= 60, key


def test_a_call_taken_back_leaves_its_tenant_out_of_turn(r: redis.Redis) -> None:
    first = _push(r, "a", b"0")
    second = _push(r, "a", b"1")
    keys = [queue_key(BASE, "a"), ready_key(BASE)]
    assert r.eval(TAKE_BACK_LUA, 2, *keys, first, "a") == 1
    assert r.zscore(ready_key(BASE), "a") is not None  # its second call still waits
    assert r.eval(TAKE_BACK_LUA, 2, *keys, second, "a") == 1
    assert r.zcard(ready_key(BASE)) == 0 and _pop(r) is None
    assert r.eval(TAKE_BACK_LUA, 2, *keys, second, "a") == 0  # already taken: nothing
