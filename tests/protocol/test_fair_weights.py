"""A tenant weight must not break the fair share for good: producers refuse a weight out of
range, and the pull clamps one an older producer already wrote to Redis.

A weight of ``1e-320`` or ``inf`` used to make the tenant's counter infinite; when the
tenant left the ready set, the lane's floor became infinite too, every later tenant was
lifted to it and they all tied (by tenant id) from then on.
"""

from __future__ import annotations

import math

import pytest
import redis

from protocol.codec import encode_request
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.store import ensure_group
from protocol.tenants import fair

KEYS = Keys()
STREAM = KEYS.requests


def _push_raw(r: redis.Redis, tenant: str, rid: str, weight: str) -> None:
    """What an older producer did: the script given any weight it was handed."""
    request = GenerateRequest(prompt="x" * 40, request_id=f"{tenant}::{rid}", tenant=tenant)
    keys, argv = fair.push_args(STREAM, request, 1.0, encode_request(request))
    argv[1] = weight
    r.execute_command("EVAL", fair.PUSH_LUA, len(keys), *keys, *argv)


def _counters(r: redis.Redis) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in r.hgetall(fair.counters(STREAM)).items()}


@pytest.mark.parametrize("weight", ["1e-320", "inf", "nan", "-1", "0"])
def test_a_bad_weight_in_redis_leaves_the_counters_finite(redis_client: redis.Redis,
                                                           weight: str) -> None:
    redis_client.flushdb()
    ensure_group(redis_client, KEYS)
    _push_raw(redis_client, "tiny", "r1", weight)
    _push_raw(redis_client, "fine", "r1", "1.0")
    entries, _ = fair.pull(redis_client, STREAM, KEYS.group, "w1", 2)
    assert len(entries) == 2
    charge = redis_client.pipeline()
    fair.queue_charge(charge, STREAM, "tiny", 30)  # the worker's correction once it ends
    charge.execute()
    assert all(math.isfinite(c) for c in _counters(redis_client).values()), \
        _counters(redis_client)
    # both left the ready set; a tenant arriving now is lifted to a finite floor, under
    # a returning one, and is served first
    _push_raw(redis_client, "fine", "r2", "1.0")
    _push_raw(redis_client, "late", "r1", "1.0")
    counters = _counters(redis_client)
    assert math.isfinite(counters["late"]) and counters["late"] < counters["fine"]
    [(_, fields)], _ = fair.pull(redis_client, STREAM, KEYS.group, "w1", 1)
    assert fields[b"tenant"] == b"late"


def test_an_infinite_floor_already_in_redis_heals(redis_client: redis.Redis) -> None:
    """A lane an older version broke: the floor is infinite. An arriving tenant starts
    from a finite counter again, so the next ones do not all tie."""
    redis_client.flushdb()
    ensure_group(redis_client, KEYS)
    redis_client.hset(fair.counters(STREAM), mapping={":floor": "inf", "old": "inf"})
    _push_raw(redis_client, "a", "r1", "1.0")
    fair.pull(redis_client, STREAM, KEYS.group, "w1", 1)
    assert all(math.isfinite(c) for t, c in _counters(redis_client).items() if t != "old")


@pytest.mark.parametrize("weight", [1e-320, math.inf, math.nan, 0.0, -1.0, 1e4, True])
def test_producers_refuse_a_weight_out_of_range(weight: float) -> None:
    request = GenerateRequest(prompt="x", request_id="t::r", tenant="t")
    with pytest.raises(ValueError, match="weight"):
        fair.push_args(STREAM, request, weight, b"")
    assert fair.check_weight(fair.MIN_WEIGHT) == fair.MIN_WEIGHT
    assert fair.check_weight(3) == 3.0
