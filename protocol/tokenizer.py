"""The tokenizer's request and reply over Redis: what the gateway asks a worker that owns
the model's tokenizer (``/tokenize``, ``/detokenize``, ``/tokenizer_info``), and its answer.

The gateway has no tokenizer (it may run on another machine than the model), so it pushes
a msgpack ``TokenizerRequest`` onto its tenant's list for the model
(``protocol/tokenizer_queue.py``: one list per tenant, served round robin) and BLPOPs the
reply key its ``reply_id`` names (``Keys.tokenizer_reply``); any live worker serving that
model pops the request, answers on the reply key and gives it a TTL that ends shortly
after the caller's deadline. Every key carries the model's hash tag, so on a Redis
Cluster they share one slot.

Both messages are bounded: a request of at most ``MAX_REQUEST_BYTES`` (the gateway's body
limit is smaller), a reply of at most ``MAX_REPLY_BYTES`` (a worker refuses to send a
larger one: 400 naming the input). A request holds only what msgpack and UTF-8 carry:
token ids in ``[0, 2**63)``, text without lone surrogates (``protocol/values.py``).

A reply carries an HTTP status: 200 with the response ``body`` (vLLM's shapes), or an
error ``status`` (400: a bad token id, a model without a chat template) with ``error``
and the ``param`` at fault. docs/protocol.md (§10) is the reference for other languages.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.codec import ProtocolError, describe_validation_error
from protocol.models import ID_PATTERN, ChatMessage
from protocol.values import first_path, unencodable

TOKENIZER_VERSION = 1
REQUEST_TTL_S = 60
"""The request list's TTL, refreshed by every push: requests that no worker took vanish."""
REPLY_TTL_S = 60
"""The longest a reply nobody popped (the gateway gave up) stays: a worker gives it until
shortly after the caller's deadline, never more than this."""
MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_REPLY_BYTES = 16 * 1024 * 1024
"""A reply's msgpack size at most: the ids (and ``token_strs``) of a text of the gateway's
``max_prompt_chars`` fit many times over; a larger one is a 400, never written."""
TOKEN_ID_LIMIT = 2**63

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
        bad = bad_token(self.tokens or [])
        if bad is not None:
            raise ValueError(bad)
        messages = [m.model_dump() for m in self.messages or []]
        broken = first_path({"prompt": self.prompt, "messages": messages, "lora_name":
                             self.lora_name, "lora_path": self.lora_path}, unencodable)
        if broken:
            raise ValueError(f"{broken}: not valid Unicode text (a lone surrogate?)")
        return self


def bad_token(tokens: list[int]) -> str | None:
    """Why ``tokens`` cannot be sent (``"tokens.3: ..."``), or None: every id must be in
    ``[0, 2**63)``. An id out of that range is not written out: it may have thousands of
    digits (and past 4,300 ``str`` refuses to write it)."""
    for i, token in enumerate(tokens):
        if not 0 <= token < TOKEN_ID_LIMIT:
            return (f"tokens.{i}: token id out of range (a token id is an integer from 0 "
                    "to 2**63 - 1)")
    return None


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
    limit = MAX_REQUEST_BYTES if cls is TokenizerRequest else MAX_REPLY_BYTES
    if len(data) > limit:
        raise ProtocolError(f"{what}: message of {len(data)} bytes exceeds {limit}")
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

