"""Request bodies -> validated requests, off the event loop when the body is large.

FastAPI validates a declared body on the event loop. A chat body of 100,000 tiny messages
(3.4 MB, under every size limit) kept the loop busy for seconds: ``/healthz`` answered in
1-2.5 s and other streams stalled. So the routes read the raw bytes and run parsing,
validation and the mapping to GenerateRequests here: inline for small bodies (a thread
hop would cost more than the work), on a worker thread past ``OFFLOAD_BYTES``.

A thread only helps where the GIL is let go, and one pydantic call holds it for as long
as it validates (0.9 s for 100,000 messages here). So the cheap bounds come first, right
after JSON parsing: the message count (``max_messages``) and the characters of all
messages (``max_prompt_chars``, counted on the raw JSON); then messages are validated in
chunks of ``CHUNK``, so the loop gets the GIL back between them.

Before any of that, the nesting depth: ``json.loads`` recurses once per ``[``/``{`` and
raises ``RecursionError`` near a thousand levels (fewer on a thread or deep in a stack),
and pydantic, the structured-output compiler and ``json.dumps`` recurse over what it
returns. A body nested more than ``MAX_DEPTH`` levels is a 400 (``check_depth``), found
without parsing or recursing.

Errors are 400s naming the field; malformed JSON names no field (``param`` is null, as
OpenAI answers), and its message says where the JSON breaks. An integer literal of more
than 4,300 digits is one too: ``json.loads`` refuses to convert it with a plain
``ValueError`` (Python's limit on integer-string conversion), which every route's body
then answered with a 500. Smaller integers out of a field's range are the field's 400
(``protocol/values.py``: what msgpack cannot carry).
"""

from __future__ import annotations

import functools
import json
import sys
import typing
from collections.abc import Callable
from itertools import accumulate
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway.errors import APIError
from gateway.field_errors import field_error

OFFLOAD_BYTES = 64 * 1024
CHUNK = 256  # messages per validation call
MAX_DEPTH = 64
"""Levels of arrays and objects a body may nest. An OpenAI-shaped body needs about 6
(body, messages, a message, its content parts, a part, image_url); a structured-output
schema adds two per level of nesting (``properties``, the property), and OpenAI caps
those at 10 levels, so 64 leaves room for far deeper schemas than any provider accepts.
It stays well below what recurses safely: Python's 1,000 frames (``json.loads`` failed
at ~990 levels here) and orjson's 255 (when it writes JSON)."""
_NOT_SYNTAX = bytes(range(256)).translate(None, b'[]{}"')
_STEP = [0] * 256  # +1 per opening bracket, -1 per closing one
for _c in b"[{":
    _STEP[_c] = 1
for _c in b"]}":
    _STEP[_c] = -1
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def run_sized(raw: bytes, work: Callable[[bytes], T]) -> T:
    """``work(raw)``, on a worker thread if the body is large."""
    if len(raw) <= OFFLOAD_BYTES:
        return work(raw)
    return await anyio.to_thread.run_sync(work, raw)


def nesting_depth(raw: bytes, at_most: int = MAX_DEPTH) -> int:
    """How deep ``raw``'s arrays and objects nest (brackets inside strings are text):
    exact above ``at_most``, at most ``at_most`` otherwise (a count of the opening
    brackets settles most bodies); no parsing, no recursion.

    Bytes-level C loops only (a 3.5 MB chat body of 100,000 messages: a little less time
    than ``json.loads`` takes for it, a tenth of pydantic's): escaped backslashes and quotes go
    first (JSON pairs a run of backslashes from its start, as ``replace`` does), then all
    but brackets and quotes; every other piece between quotes is outside the strings,
    and the deepest point is the largest running sum of +1/-1 over its brackets. Malformed
    JSON gets a number too; ``json.loads`` then says where it breaks.
    """
    if raw.count(b"[") + raw.count(b"{") <= at_most:
        return 0
    return max(accumulate(map(_STEP.__getitem__, brackets(raw)[0])), default=0)


def brackets(raw: bytes) -> tuple[bytes, bool]:
    """The brackets of ``raw`` outside its strings, in order, and whether ``raw`` ends
    inside a string (``nesting_depth``)."""
    syntax = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_SYNTAX)
    pieces = syntax.split(b'"')
    return b"".join(pieces[::2]), len(pieces) % 2 == 0


def check_depth(raw: bytes, outer: int = 0) -> None:
    """400 when the body in ``raw`` nests deeper than ``MAX_DEPTH``, before anything
    recurses over it; ``outer``: levels ``raw`` wraps the body in (a batch line: 1)."""
    depth = nesting_depth(raw, MAX_DEPTH + outer) - outer
    if depth > MAX_DEPTH:
        raise APIError(400, f"body: nested too deep ({depth} levels of arrays and objects; "
                       f"the limit is {MAX_DEPTH})")


def parse_json(raw: bytes, max_messages: int | None = None,
               max_chars: int | None = None) -> dict[str, Any]:
    """The body as a JSON object; 400 if it is not one, nests deeper than ``MAX_DEPTH``,
    or its messages are too many or too long (counted before any model is built)."""
    check_depth(raw)
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "body: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"body: not valid JSON ({exc.msg} at line {exc.lineno} column "
                       f"{exc.colno})") from None
    except ValueError:  # an integer of more digits than Python converts (4,300)
        raise APIError(400, f"body: a number has more than {sys.get_int_max_str_digits()} "
                       "digits") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(obj).__name__}")
    messages = obj.get("messages")
    if not isinstance(messages, list):
        return obj
    if max_messages is not None and len(messages) > max_messages:
        raise APIError(400, f"messages: {len(messages)} messages exceed the limit of "
                       f"{max_messages}", param="messages")
    if max_chars is not None:
        chars = sum(_chars(m.get("content")) for m in messages if isinstance(m, dict))
        if chars > max_chars:
            raise APIError(400, f"messages: {chars} characters exceed the limit of "
                           f"{max_chars}", param="messages")
    return obj


def _chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def validate(model: type[M], obj: dict[str, Any]) -> M:
    """``model`` from a parsed body, strictly typed; 400 naming the field otherwise. A long
    ``messages`` list is validated ``CHUNK`` messages per call."""
    messages = obj.get("messages")
    if not isinstance(messages, list) or len(messages) <= CHUNK:
        return _validate(model, obj)
    adapter = _messages_adapter(model)
    validated: list[Any] = []
    for lo in range(0, len(messages), CHUNK):
        try:
            validated += adapter.validate_python(messages[lo:lo + CHUNK], strict=True)
        except ValidationError as exc:
            errors = [{**e, "loc": ("messages", lo + int(e["loc"][0]), *e["loc"][1:])}
                      for e in exc.errors()]
            raise APIError(400, *field_error(errors, model)) from None
    rest = _validate(model, {**obj, "messages": messages[:1]})
    return rest.model_copy(update={"messages": validated})


def _validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise validation_error(exc, model) from None


@functools.cache
def _messages_adapter(model: type[BaseModel]) -> TypeAdapter[list[Any]]:
    (item,) = typing.get_args(_list_type(model.model_fields["messages"].annotation))
    return TypeAdapter(list[item])  # type: ignore[valid-type]


def _list_type(annotation: Any) -> Any:
    """``list[X]`` out of ``list[X] | None``."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            return arg
    raise TypeError(f"messages is not a list field: {annotation}")


def validation_error(exc: ValidationError, model: Any = None) -> APIError:
    """A 400 whose ``param`` is the field at fault, dotted (``messages.0.role``): its
    location (without pydantic's union branches, ``gateway/field_errors.py``: ``model``
    is the type validated), else the field a model validator's message starts with
    (``"logit_bias: ..."``)."""
    message, param = field_error(exc.errors(), model)
    return APIError(400, message, param=param)
