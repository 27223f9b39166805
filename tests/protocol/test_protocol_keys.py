"""Key names: the single-Redis names stay as they were; the cluster names put each request
in one slot and spread the request-stream shards over the masters."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from protocol.cluster.keys import ClusterKeys, keys_for, request_tag
from protocol.cluster.shard_slots import MAX_SHARDS, SHARD_SLOT_WINDOWS, slot_ranges
from protocol.keys import PRIORITY_BANDS, Keys


def slot(name: str) -> int:
    return key_slot(name.encode())


def test_single_redis_names_are_unchanged() -> None:
    keys = Keys()
    assert keys.request_streams == ("ferry:requests:high", "ferry:requests", "ferry:requests:low")
    assert keys.shards == 1 and keys.shard_of("anything") == 0
    assert keys.stream_for("abc", -5) == "ferry:requests:high"
    assert keys.stream_for("abc", 0) == "ferry:requests"
    assert keys.dead_letter_for("ferry:requests:low") == "ferry:requests:dead"
    assert keys.dead_letters == ("ferry:requests:dead",)
    assert keys.job("abc") == "ferry:job:abc" and keys.tokens("abc") == "ferry:tokens:abc"
    assert keys.worker("w") == "ferry:worker:w" and keys.workers == "ferry:workers"
    assert keys_for("ferry") == keys and not keys.cluster


def test_every_key_of_a_request_shares_the_slot_of_its_tag() -> None:
    keys = ClusterKeys("ferry", 3)
    for rid in ("abc", "0123456789abcdef0123456789abcdef", "a:b.c-d_e"):
        names = [keys.job(rid), keys.events(rid), keys.cancelled(rid), keys.tokens(rid)]
        assert {slot(n) for n in names} == {slot(request_tag(rid))} == {slot(rid)}
        assert all(request_tag(rid) in n for n in names)
    assert keys.job("abc") == "ferry:job:{abc}"


def test_a_shard_keeps_its_lanes_and_dead_letters_in_its_window() -> None:
    keys = ClusterKeys("ferry", MAX_SHARDS)
    for k in range(MAX_SHARDS):
        lanes = keys.shard_streams(k)
        dead = keys.dead_letter_for(lanes[1])
        slots = {slot(s) for s in (*lanes, dead)}
        assert len(slots) == 1
        low, high = SHARD_SLOT_WINDOWS[k]
        assert low <= slots.pop() <= high
        assert [keys.shard_of_stream(s) for s in lanes] == [k, k, k]
    assert len(set(keys.request_streams)) == 3 * MAX_SHARDS
    # lane-major: every shard's high lane before any normal lane
    assert keys.request_streams[:MAX_SHARDS] == keys.lane_streams("high")


@pytest.mark.parametrize("shards", range(1, MAX_SHARDS + 1))
def test_the_first_s_shards_fall_in_s_different_slot_ranges(shards: int) -> None:
    """So S shards spread evenly over M masters (S a multiple of M) for every S."""
    ranges = slot_ranges(shards)
    keys = ClusterKeys("ferry", shards)
    cells = set()
    for k in range(shards):
        s = slot(keys.shard_streams(k)[0])
        cells.add(next(j for j, (a, b) in enumerate(ranges) if a <= s <= b))
    assert len(cells) == shards
    for masters in (m for m in range(3, shards + 1) if shards % m == 0):
        per_master = [0] * masters
        for k in range(shards):
            s = slot(keys.shard_streams(k)[0])
            per_master[next(j for j, (a, b) in enumerate(slot_ranges(masters))
                            if a <= s <= b)] += 1
        assert per_master == [shards // masters] * masters


def test_shard_names_do_not_change_when_shards_are_added() -> None:
    small, large = ClusterKeys("ferry", 3), ClusterKeys("ferry", 6)
    assert [small.shard_streams(k) for k in range(3)] == [large.shard_streams(k)
                                                          for k in range(3)]


def test_requests_spread_over_shards_next_to_their_keys() -> None:
    keys = ClusterKeys("ferry", 3)
    counts = [0, 0, 0]
    ranges = slot_ranges(3)
    for i in range(3000):
        rid = f"{i:032x}"
        stream = keys.stream_for(rid, 0)
        counts[keys.shard_of_stream(stream)] += 1
        cell = [j for j, (a, b) in enumerate(ranges) if a <= slot(rid) <= b]
        assert cell == [j for j, (a, b) in enumerate(ranges) if a <= slot(stream) <= b]
    assert min(counts) > 800


def test_bad_inputs_are_refused_with_the_name() -> None:
    with pytest.raises(ValueError, match="shards"):
        ClusterKeys("ferry", 0)
    with pytest.raises(ValueError, match="shards"):
        ClusterKeys("ferry", MAX_SHARDS + 1)
    with pytest.raises(ValueError, match="shard: 3"):
        ClusterKeys("ferry", 3).shard_streams(3)
    with pytest.raises(ValueError, match="band"):
        ClusterKeys("ferry", 3).lane_streams("urgent")
    with pytest.raises(ValueError, match="not a request stream"):
        ClusterKeys("ferry", 3).dead_letter_for("ferry:requests")
    with pytest.raises(TypeError, match="sharded"):
        _ = ClusterKeys("ferry", 3).requests
    with pytest.raises(ValueError, match="prefix"):
        ClusterKeys("bad prefix", 3)
    assert PRIORITY_BANDS == ("high", "normal", "low")


def test_prefixes_get_their_own_shard_tags() -> None:
    a, b = ClusterKeys("ferry", 3), ClusterKeys("other", 3)
    assert not set(a.request_streams) & set(b.request_streams)
    assert a.workers == "ferry:workers:{ferry}" and a.worker("w1") == "ferry:worker:{ferry}:w1"
    assert slot(a.workers) == slot(a.worker("w1")) == slot(a.restarts)


@pytest.mark.parametrize("model", ["default", "Qwen/Qwen2.5-0.5B", "my model {v2}",
                                   "x" * 200, "ünï"])
def test_a_models_tokenizer_request_and_reply_share_a_slot(model: str) -> None:
    """The gateway pushes the request and BLPOPs the reply: one slot, whatever the name
    (braces, spaces or length in a name become a digest tag, never a broken one)."""
    for keys in (Keys(), ClusterKeys("ferry", 3)):
        request, reply = keys.tokenizer_requests(model), keys.tokenizer_reply(model, "r1")
        assert slot(request) == slot(reply) and reply.startswith(request + ":reply:")
        tag = request[request.index("{") + 1:request.rindex("}")]
        assert "{" not in tag and "}" not in tag and 0 < len(tag) <= 128
    assert Keys().tokenizer_requests("default") == "ferry:tokenizer:{default}"
    assert Keys().tokenizer_requests("a b") != Keys().tokenizer_requests("a c")
