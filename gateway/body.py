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

Errors are 400s naming the field; malformed JSON names no field (``param`` is null, as
OpenAI answers), and its message says where the JSON breaks.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway.errors import APIError
from protocol.codec import describe_errors

OFFLOAD_BYTES = 64 * 1024
CHUNK = 256  # messages per validation call
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def run_sized(raw: bytes, work: Callable[[bytes], T]) -> T:
    """``work(raw)``, on a worker thread if the body is large."""
    if len(raw) <= OFFLOAD_BYTES:
        return work(raw)
    return await anyio.to_thread.run_sync(work, raw)


def parse_json(raw: bytes, max_messages: int | None = None,
               max_chars: int | None = None) -> dict[str, Any]:
    """The body as a JSON object; 400 if it is not one, or its messages are too many or
    too long (counted before any model is built)."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "body: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"body: not valid JSON ({exc.msg} at line {exc.lineno} column "
                       f"{exc.colno})") from None
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
            raise _error(errors) from None
    rest = _validate(model, {**obj, "messages": messages[:1]})
    return rest.model_copy(update={"messages": validated})


def _validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


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


def validation_error(exc: ValidationError) -> APIError:
    """A 400 whose ``param`` is the field at fault, dotted (``messages.0.role``): its
    location, else the field a model validator's message starts with
    (``"logit_bias: ..."``)."""
    return _error(exc.errors())


def _error(errors: Any) -> APIError:
    message = describe_errors(errors)
    loc = ".".join(str(p) for p in errors[0].get("loc", ())) if errors else ""
    named = message.split(":", 1)[0]
    param = loc or (named if named and " " not in named else None)
    return APIError(400, message, param=param)
