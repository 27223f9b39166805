"""The msgpack codec: round-trips, strict refusal naming the field, and fuzzing."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import (
    ProtocolError,
    decode_cancel,
    decode_entry,
    decode_event,
    decode_event_trusted,
    decode_heartbeat,
    decode_request,
    encode_cancel,
    encode_event,
    encode_heartbeat,
    encode_request,
    request_fields,
    status_from_hash,
    status_to_hash,
)
from protocol.keys import Keys
from protocol.models import (
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Cancel,
    ChatMessage,
    ChoiceResult,
    GenerateRequest,
    JobStatus,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerHeartbeat,
)
from protocol.sampling import SamplingParams

DECODERS = [decode_request, decode_event, decode_event_trusted, decode_cancel,
            decode_heartbeat]


def _raw(**fields: object) -> bytes:
    return msgpack.packb({"version": 1, **fields}, use_bin_type=True)


@pytest.mark.parametrize(
    "request_",
    [
        GenerateRequest(prompt="Hello"),
        GenerateRequest(prompt_token_ids=[1, 2, 3], priority=-5, timeout_s=2.5, stream=False),
        GenerateRequest(
            messages=[ChatMessage(role="system", content="Be brief."),
                      ChatMessage(role="user", content="héllo ✓")],
            params=SamplingParams(temperature=0.7, top_p=0.9, stop=["\n"], seed=7, logprobs=2),
            model="tiny",
        ),
    ],
)
def test_request_round_trip(request_: GenerateRequest) -> None:
    assert decode_request(encode_request(request_)) == request_
    assert decode_entry(request_fields(request_)) == request_
    assert decode_entry({k.encode(): v for k, v in request_fields(request_).items()}) == request_


def test_request_defaults() -> None:
    a, b = GenerateRequest(prompt="x"), GenerateRequest(prompt="x")
    assert a.request_id != b.request_id and len(a.request_id) == 32
    assert a.version == PROTOCOL_VERSION == 7 and a.tenant is None
    assert a.created_at > 1.6e9 and a.priority == 0


def test_version_1_messages_are_still_read() -> None:
    """Version 2 only added fields: a version-1 producer's request decodes the same."""
    old = decode_request(msgpack.packb({"version": 1, "prompt": "x", "priority": 3,
                                        "params": {"max_tokens": 5}}, use_bin_type=True))
    assert old.version == 1 and old.params.max_tokens == 5 and old.params.n == 1


def test_version_5_fields_round_trip_and_older_messages_mean_the_same() -> None:
    """Version 5 added the prompt controls, the token bans and ``stop_reason``: they
    round-trip (a stop reason keeps its type, string or token id, in the job hash too),
    and a version-4 request without them means what it meant."""
    request = GenerateRequest(
        messages=[ChatMessage(role="user", content="hi"),
                  ChatMessage(role="assistant", content="Well")],
        add_generation_prompt=False, continue_final_message=True,
        chat_template_kwargs={"enable_thinking": False, "tags": ["a", 1]},
        params=SamplingParams(truncate_prompt_tokens=-1, bad_words=["x y"],
                              allowed_token_ids=[3, 4]))
    assert decode_request(encode_request(request)) == request
    fim = GenerateRequest(prompt="def f(", suffix="  return 1")
    assert decode_request(encode_request(fim)).suffix == "  return 1"
    old = decode_request(msgpack.packb({"version": 4, "messages": [
        {"role": "user", "content": "x"}]}, use_bin_type=True))
    assert old.add_generation_prompt and not old.continue_final_message
    assert old.chat_template_kwargs is None and old.params.bad_words is None
    for reason in ("\n\n", 7):
        event = TokenEvent(request_id="r", seq=1, finish_reason="stop", stop_reason=reason,
                           choices=[ChoiceResult(index=0, stop_reason=reason)])
        assert decode_event(encode_event(event)) == event
        status = JobStatus(request_id="r", state="done", stop_reason=reason)
        assert status_from_hash(status_to_hash(status)).stop_reason == reason


def test_event_status_cancel_heartbeat_round_trip() -> None:
    event = TokenEvent(
        request_id="r1", seq=3, token_ids=[5], text="é", finish_reason="length",
        usage=Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6),
        timings=Timings(queued_s=0.1, ttft_s=0.2, total_s=0.3), worker_id="w",
        logprobs=[TokenLogprob(token_id=5, logprob=-0.1, token="é",
                               top=[TopLogprob(token_id=6, logprob=-2.0)])],
    )
    assert decode_event(encode_event(event)) == event
    assert event.is_final and not TokenEvent(request_id="r1", seq=0).is_final
    cancel = Cancel(request_id="r1", reason="bye")
    assert decode_cancel(encode_cancel(cancel)) == cancel
    beat = WorkerHeartbeat(worker_id="w-1", model="m", started_at=1.0, updated_at=2.0,
                           stats={"running": 3, "kv_usage": 0.5})
    assert decode_heartbeat(encode_heartbeat(beat)) == beat


def test_job_hash_round_trip_is_plain_strings() -> None:
    status = JobStatus(request_id="r", state="done", text="hi", token_ids=[1, 2],
                       finish_reason="stop", usage=Usage(total_tokens=2), created_at=1.25)
    fields = status_to_hash(status)
    assert fields["state"] == "done" and fields["token_ids"] == "[1,2]"
    assert "error" not in fields
    assert status_from_hash({k.encode(): v.encode() for k, v in fields.items()}) == status
    assert status_from_hash({**fields, "future_field": "x"}) == status


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"\xc1", "GenerateRequest"),
        (b"", "GenerateRequest"),
        (msgpack.packb([1, 2]), "GenerateRequest"),
        (msgpack.packb({"prompt": "x"}), "version"),
        (msgpack.packb({"version": 8, "prompt": "x"}), "version"),
        (msgpack.packb({"version": "1", "prompt": "x"}), "version"),
        (_raw(), "prompt"),
        (_raw(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt"),
        (_raw(prompt="x", params={"temperature": "hot"}), "params.temperature"),
        (_raw(prompt="x", params={"temperature": -1.0}), "params.temperature"),
        (_raw(prompt="x", params={"min_tokens": 9, "max_tokens": 2}), "params.min_tokens"),
        (_raw(prompt="x", params={"max_tokens": True}), "params.max_tokens"),
        (_raw(prompt_token_ids=["1"]), "prompt_token_ids.0"),
        (_raw(prompt_token_ids=[-1]), "prompt_token_ids"),
        (_raw(messages=[{"role": "user"}]), "messages.0.content"),
        (_raw(prompt="x", request_id="a b"), "request_id"),
        (_raw(prompt="x", max_tokens=3), "max_tokens"),
        (_raw(prompt=b"bytes"), "prompt"),
        (_raw(prompt="x", priority=1.5), "priority"),
    ],
)
def test_bad_request_is_refused_naming_the_field(data: bytes, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(data)
    assert str(info.value).startswith(field), str(info.value)


def test_bad_event_and_entry() -> None:
    with pytest.raises(ProtocolError, match=r"^seq: "):
        decode_event(_raw(request_id="r", seq=-1))
    with pytest.raises(ProtocolError, match=r"^finish_reason: "):
        decode_event(_raw(request_id="r", seq=0, finish_reason="done"))
    with pytest.raises(ProtocolError, match=r"^data: "):
        decode_entry({b"payload": b"x"})
    with pytest.raises(ProtocolError, match="expected msgpack bytes"):
        decode_event("not bytes")
    with pytest.raises(ProtocolError, match=r"^token_ids: "):
        status_from_hash({b"request_id": b"r", b"state": b"done", b"token_ids": b"[1,"})
    with pytest.raises(ProtocolError, match=r"^state: "):
        status_from_hash({b"request_id": b"r", b"state": b"exploded"})


def test_keys_names_and_prefix() -> None:
    keys = Keys()
    assert keys.requests == "ferry:requests" and keys.group == "ferry-workers"
    assert keys.tokens("a") == "ferry:tokens:a" and keys.events("a") == "ferry:events:a"
    assert keys.job("a") == "ferry:job:a" and keys.cancelled("a") == "ferry:cancelled:a"
    assert keys.worker("w") == "ferry:worker:w" and keys.workers == "ferry:workers"
    assert keys.control == "ferry:control" and keys.dead_letter == "ferry:requests:dead"
    assert Keys("t1").job("x") == "t1:job:x"
    with pytest.raises(ValueError, match="prefix"):
        Keys("bad prefix*")


# --- fuzzing -----------------------------------------------------------------------------

_FIELD_NAMES = st.sampled_from(
    ["version", "request_id", "prompt", "prompt_token_ids", "messages", "params", "seq",
     "token_ids", "text", "finish_reason", "usage", "role", "content", "temperature",
     "max_tokens", "stop", "reason", "worker_id", "model", "stats", "logprobs", "top"]
)
_SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=20)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(_FIELD_NAMES | st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
_MAPS = st.dictionaries(_FIELD_NAMES, _VALUES, max_size=8).map(
    lambda d: {**d, "version": 1} if len(d) % 2 else d
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_garbage_bytes_only_raise_protocol_error(data: bytes) -> None:
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):
            decode(data)


@FUZZ
@given(_MAPS)
def test_fuzz_structured_maps_only_raise_protocol_error(obj: dict[str, object]) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    for decode in DECODERS:
        try:
            decoded = decode(data)
        except ProtocolError:
            continue
        assert decoded.version in SUPPORTED_VERSIONS


def test_trusted_event_decoder_matches_the_strict_one() -> None:
    """The token path's decoder builds per-step events without validation; it must give
    the very same TokenEvent, and leave everything else to the strict path."""
    per_step = TokenEvent(request_id="r-1", seq=3, token_ids=[5, 6], text="hé")
    final = TokenEvent(request_id="r-1", seq=4, finish_reason="stop", usage=Usage(),
                       worker_id="w")
    for event in (per_step, final, TokenEvent(request_id="r-1", seq=0)):
        data = encode_event(event)
        fast, strict = decode_event_trusted(data), decode_event(data)
        assert fast == strict == event
        assert fast.model_dump() == strict.model_dump()
        assert fast.model_fields_set == strict.model_fields_set
    for bad, field in ((_raw(request_id="r", seq="3"), "seq"),
                       (_raw(request_id="r", seq=-1), "seq"),
                       (_raw(request_id="r", seq=1, token_ids=["a"]), "token_ids"),
                       (_raw(request_id="r", seq=1, text=b"x"), "text"),
                       (_raw(seq=1), "request_id"),
                       (_raw(request_id="r", seq=1, extra=1), "extra"),
                       (msgpack.packb({"version": 9, "request_id": "r", "seq": 0}), "version")):
        with pytest.raises(ProtocolError, match=field):
            decode_event_trusted(bad)
