"""msgpack encoding of the wire models, with strict validation on the way in.

Decoders are the trust boundary: anything can be XADDed or PUBLISHed by any client, so
every decoder turns every failure (bad msgpack, wrong top-level type, unknown version,
missing or wrong-typed field) into one exception type, ``ProtocolError``, whose message
names the offending field. Workers send such entries to the dead-letter stream instead of
crashing; the gateway turns them into a 4xx.

Validation is pydantic's *strict* mode: msgpack carries real types, so ``"5"`` for an int
is a producer bug worth reporting, not something to coerce silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from protocol.models import (
    SUPPORTED_VERSIONS,
    Cancel,
    GenerateRequest,
    JobStatus,
    TokenEvent,
    WorkerHeartbeat,
)

REQUEST_FIELD = "data"
"""The one field of a requests-stream entry; its value is the msgpack GenerateRequest."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MAX_REPORTED_ERRORS = 3
_NAMED_MSG = re.compile(r"^([A-Za-z_]\w*): (.*)$", re.DOTALL)

M = TypeVar("M", bound=BaseModel)


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not match the schema; names the field."""


def describe_errors(errors: Sequence[Mapping[str, Any]], skip_loc: int = 0) -> str:
    """``"params.temperature: Input should be ..."``: dotted field path, then the reason.

    Takes pydantic's ``errors()`` list (FastAPI's too); ``skip_loc`` drops leading location
    parts such as FastAPI's ``"body"``.
    """
    parts = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        loc = ".".join(str(p) for p in tuple(err.get("loc", ()))[skip_loc:])
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        named = _NAMED_MSG.match(msg)  # model validators name their field: "stop: ..."
        if named and loc and loc.split(".")[-1] == named[1]:  # "logit_bias: ..." on logit_bias
            parts.append(f"{loc}: {named[2]}")
        elif named and loc:
            parts.append(f"{loc}.{named[1]}: {named[2]}")
        else:
            parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > len(parts):
        parts.append(f"(+{len(errors) - len(parts)} more)")
    return "; ".join(parts)


def describe_validation_error(exc: ValidationError) -> str:
    return describe_errors(exc.errors())


def _pack(model: BaseModel) -> bytes:
    payload = model.model_dump(mode="python", exclude_none=True)
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


_BYTES = (bytes, bytearray, memoryview)


def _unpack_map(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, _BYTES):
        raise ProtocolError(f"{what}: expected msgpack bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{what}: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise ProtocolError(f"{what}: not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    return obj


def check_version(obj: Mapping[str, Any]) -> None:
    """Refuse a message whose ``version`` is missing or not one this code understands."""
    if "version" not in obj:
        raise ProtocolError("version: Field required")
    version = obj["version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(f"version: Input should be an integer, got {type(version).__name__}")
    if version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        raise ProtocolError(
            f"version: unsupported protocol version {version} (supported: {supported})"
        )


def _validate(cls: type[M], obj: Any, strict: bool = True) -> M:
    try:
        return cls.model_validate(obj, strict=strict)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc)) from None
    except Exception as exc:  # a validator tripping over exotic input must not escape
        raise ProtocolError(f"{cls.__name__}: invalid ({type(exc).__name__}: {exc})") from None


def _decode(cls: type[M], data: Any) -> M:
    obj = _unpack_map(data, cls.__name__)
    check_version(obj)
    return _validate(cls, obj)


def encode_request(request: GenerateRequest) -> bytes:
    return _pack(request)


def decode_request(data: Any) -> GenerateRequest:
    return _decode(GenerateRequest, data)


def request_fields(request: GenerateRequest) -> dict[str, bytes]:
    """The field map to XADD for one request."""
    return {REQUEST_FIELD: encode_request(request)}


def decode_entry(fields: Mapping[Any, Any]) -> GenerateRequest:
    """Decode a requests-stream entry as returned by XREADGROUP (bytes or str keys)."""
    raw = fields.get(REQUEST_FIELD.encode(), fields.get(REQUEST_FIELD))
    if raw is None:
        raise ProtocolError(f"{REQUEST_FIELD}: stream entry has no '{REQUEST_FIELD}' field")
    return decode_request(raw)


def encode_event(event: TokenEvent) -> bytes:
    return _pack(event)


def decode_event(data: Any) -> TokenEvent:
    return _decode(TokenEvent, data)


_TRUSTED_KEYS = frozenset({"version", "request_id", "seq", "token_ids", "text", "index"})


def decode_event_trusted(data: Any) -> TokenEvent:
    """``decode_event`` for the token path, where events come from our own workers.

    The gateway decodes every token of every stream, and pydantic's strict validation is
    a good part of its per-event cost. Events the worker emits per step carry just these
    five fields; after the version check and a few type checks (those the ordering logic
    relies on; the request id is compared with the subscription's by the sequencer) they
    are built without validation. Anything else (a terminal event with
    usage, logprobs, an unexpected field or type) takes the strict path, so malformed
    input still ends in a ``ProtocolError`` naming the field.
    """
    obj = _unpack_map(data, "TokenEvent")
    check_version(obj)
    if obj.keys() <= _TRUSTED_KEYS:
        seq, rid = obj.get("seq"), obj.get("request_id")
        token_ids, text = obj.get("token_ids", []), obj.get("text", "")
        index = obj.get("index", 0)
        if (type(seq) is int and seq >= 0 and type(rid) is str and type(text) is str
                and type(index) is int and index >= 0
                and type(token_ids) is list and all(type(t) is int for t in token_ids)):
            return _build_event(obj, token_ids)
    return _validate(TokenEvent, obj)


_EVENT_DEFAULTS = {name: field.default for name, field in TokenEvent.model_fields.items()
                   if not field.is_required() and field.default_factory is None}
_new, _set = object.__new__, object.__setattr__


def _build_event(obj: dict[str, Any], token_ids: list[int]) -> TokenEvent:
    """A TokenEvent from already-checked fields, the way pydantic's ``model_construct``
    builds one, minus its per-call introspection (which costs more than validating)."""
    event = _new(TokenEvent)
    values = {**_EVENT_DEFAULTS, **obj, "token_ids": token_ids}
    _set(event, "__dict__", values)
    _set(event, "__pydantic_fields_set__", set(obj))
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    return event


def encode_cancel(cancel: Cancel) -> bytes:
    return _pack(cancel)


def decode_cancel(data: Any) -> Cancel:
    return _decode(Cancel, data)


def encode_heartbeat(heartbeat: WorkerHeartbeat) -> bytes:
    return _pack(heartbeat)


def decode_heartbeat(data: Any) -> WorkerHeartbeat:
    return _decode(WorkerHeartbeat, data)


# --- job hash ----------------------------------------------------------------------------
# The job hash is read by humans (redis-cli HGETALL) and by services in other languages, so
# it holds plain strings: text fields as-is, numbers in decimal, lists/objects as JSON.

_JSON_FIELDS = frozenset({"token_ids", "usage", "timings", "choices", "stop_reason"})
_FLOAT_FIELDS = frozenset({"created_at", "started_at", "finished_at"})


def status_to_hash(status: JobStatus) -> dict[str, str]:
    """The HSET mapping for a job status; fields that are None are left out."""
    out: dict[str, str] = {}
    for name, value in status.model_dump(mode="json", exclude_none=True).items():
        if name in _JSON_FIELDS:
            out[name] = json.dumps(value, separators=(",", ":"))
        else:
            out[name] = repr(value) if isinstance(value, float) else str(value)
    return out


def status_from_hash(fields: Mapping[Any, Any]) -> JobStatus:
    """Parse HGETALL output (bytes or str); unknown fields are ignored, bad ones refused."""
    parsed: dict[str, Any] = {}
    for raw_key, raw_value in fields.items():
        try:
            key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            value = raw_value.decode() if isinstance(raw_value, bytes) else str(raw_value)
        except UnicodeDecodeError:
            raise ProtocolError("job: hash field is not valid UTF-8") from None
        if key not in JobStatus.model_fields:
            continue
        try:
            if key in _JSON_FIELDS:
                parsed[key] = json.loads(value)
            elif key in _FLOAT_FIELDS:
                parsed[key] = float(value)
            else:
                parsed[key] = value
        except ValueError:
            raise ProtocolError(f"{key}: cannot parse job hash value {value[:40]!r}") from None
    return _validate(JobStatus, parsed)
