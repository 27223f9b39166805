"""The tokenizer's request and reply over Redis: what the gateway asks a worker that owns
the model's tokenizer (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), and its answer.

The gateway has no tokenizer (it may run on another machine than the model), so it pushes
a msgpack ``TokenizerRequest`` onto the model's list (``Keys.tokenizer_requests``) and
BLPOPs the reply key its ``reply_id`` names (``Keys.tokenizer_reply``); any live worker
serving that model pops the request, answers on the reply key and gives it a short TTL.
Both keys carry the model's hash tag, so on a Redis Cluster they share one slot.

A reply carries an HTTP status: 200 with the response ``body`` (vLLM's shapes), or an
error ``status`` (400: a bad token id, a model without a chat template) with ``error``
and the ``param`` at fault. docs/protocol.md (§10) is the reference for other languages.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, describe_validation_error
from protocol.models import ID_PATTERN, ChatMessage

TOKENIZER_VERSION = 1
REQUEST_TTL_S = 60
"""The request list's TTL, refreshed by every push: requests that no worker took vanish."""
REPLY_TTL_S = 60
"""A reply nobody popped (the gateway gave up) vanishes after this long."""

TokenizerOp = Literal["tokenize", "detokenize", "info", "check_lora"]
"""``check_lora``: a worker loads the adapter at ``lora_path`` against its base model and
answers 200 (its rank and modules) or 400 with the reason; nothing is registered."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_M = TypeVar("_M", bound=_Message)


class TokenizerRequest(_Message):
    """One ``/tokenize`` (``prompt`` or ``messages``), ``/detokenize`` (``tokens``) or
    ``/tokenizer_info`` (no input) call; ``deadline`` (unix time) is when the caller stops
    waiting: a worker that pops it later drops it."""

    version: int = TOKENIZER_VERSION
    op: TokenizerOp
    reply_id: str = Field(pattern=ID_PATTERN)
    deadline: float
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tokens: list[int] | None = None
    add_special_tokens: bool | None = None  # None: the default (prompt: true, chat: false)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    lora_name: str | None = Field(default=None, max_length=128)
    lora_path: str | None = Field(default=None, max_length=4096)

    @model_validator(mode="after")
    def _inputs_fit_op(self) -> TokenizerRequest:
        given = {name for name in ("prompt", "messages", "tokens", "lora_path")
                 if getattr(self, name) is not None}
        wanted = {"tokenize": ({"prompt"}, {"messages"}), "detokenize": ({"tokens"},),
                  "info": (set(),), "check_lora": ({"lora_path"},)}[self.op]
        if given not in wanted:
            names = " or ".join(", ".join(sorted(w)) or "nothing" for w in wanted)
            raise ValueError(f"op: {self.op} takes {names}, got "
                             f"{', '.join(sorted(given)) or 'nothing'}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: cannot be combined with "
                             "add_generation_prompt")
        return self


class TokenizerReply(_Message):
    """The answer: ``status`` 200 and the HTTP ``body``, or an error with its ``param``."""

    version: int = TOKENIZER_VERSION
    status: int = Field(ge=200, le=599)
    body: dict[str, Any] | None = None
    error: str | None = None
    param: str | None = None


def encode_tokenizer_message(message: TokenizerRequest | TokenizerReply) -> bytes:
    payload = message.model_dump(mode="python", exclude_none=True)
    return msgpack.packb(payload, use_bin_type=True)  # type: ignore[no-any-return]


def decode_tokenizer_request(data: Any) -> TokenizerRequest:
    return _decode(TokenizerRequest, data)


def decode_tokenizer_reply(data: Any) -> TokenizerReply:
    return _decode(TokenizerReply, data)


def _decode(cls: type[_M], data: Any) -> _M:
    """Strict decoding: every failure is a ``ProtocolError`` naming the field."""
    what = cls.__name__
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what}: expected msgpack bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{what}: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise ProtocolError(f"{what}: not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    if obj.get("version") != TOKENIZER_VERSION:
        raise ProtocolError(f"version: unsupported tokenizer message version "
                            f"{obj.get('version')!r} (supported: {TOKENIZER_VERSION})")
    try:
        return cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc)) from None

