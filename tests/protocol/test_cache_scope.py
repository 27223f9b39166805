"""The prefix cache's partition on the wire (protocol version 7): ``cache_salt`` and
``cache_scope`` on a GenerateRequest, ``cached_tokens`` in Usage, and the partition the
worker derives from a request's tenant, group and salt (``protocol/tenants/cache_scope.py``)."""

from __future__ import annotations

import msgpack
import pytest

from protocol.codec import (
    ProtocolError,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
    status_from_hash,
    status_to_hash,
)
from protocol.models import GenerateRequest, JobStatus, TokenEvent, Usage
from protocol.tenants.cache_scope import MAX_CACHE_SALT_CHARS, cache_partition


def test_fields_round_trip_and_older_versions_mean_the_same() -> None:
    request = GenerateRequest(request_id="acme::r1", tenant="acme", prompt="x",
                              cache_salt="user-42 ✓", cache_scope="public")
    assert decode_request(encode_request(request)) == request
    for version in (4, 6):  # read as before: the tenant's own partition, no salt
        old = decode_request(msgpack.packb({"version": version, "prompt": "x",
                                            "tenant": "acme", "request_id": "acme::r"},
                                           use_bin_type=True))
        assert old.cache_salt is None and old.cache_scope is None
    usage = Usage(prompt_tokens=40, completion_tokens=2, total_tokens=42, cached_tokens=32)
    event = TokenEvent(request_id="r", seq=3, finish_reason="stop", usage=usage)
    assert decode_event(encode_event(event)).usage == usage
    status = JobStatus(request_id="r", state="done", usage=usage)
    assert status_from_hash(status_to_hash(status)).usage == usage
    assert Usage().cached_tokens is None  # an older worker's: not reported


@pytest.mark.parametrize("fields, param", [
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "x" * (MAX_CACHE_SALT_CHARS + 1)}, "cache_salt"),
    ({"cache_salt": "a\nb"}, "cache_salt"),
    ({"cache_salt": "\x00"}, "cache_salt"),
    ({"cache_salt": 7}, "cache_salt"),
    ({"cache_scope": "a b"}, "cache_scope"),
    ({"cache_scope": "g::x"}, "cache_scope"),
])
def test_bad_values_are_refused_naming_the_field(fields: dict[str, object], param: str
                                                 ) -> None:
    raw = msgpack.packb({"version": 7, "prompt": "x", **fields}, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        decode_request(raw)
    assert str(info.value).startswith(param), str(info.value)


def test_partitions() -> None:
    # the default tenant without group or salt: the shared default space, as before
    assert cache_partition(None, None, None) is None
    assert cache_partition("default", None, None) is None
    spaces = {
        cache_partition("a", None, None), cache_partition("b", None, None),
        cache_partition("a", None, "s1"), cache_partition("a", None, "s2"),
        cache_partition(None, None, "s1"), cache_partition("a", "public", None),
        cache_partition("public", None, None),  # a tenant named as a group is not it
        cache_partition("a", "public", "s1"),
    }
    assert len(spaces) == 8 and None not in spaces
    # one group is one space whoever its tenant
    assert cache_partition("a", "public", None) == cache_partition("b", "public", None)
    assert cache_partition("a", "public", "s") == cache_partition("b", "public", "s")
    # a salt cannot forge another partition's encoding
    assert cache_partition("a", None, '", "b') != cache_partition("a", None, None)
