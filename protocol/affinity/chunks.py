"""A request's prefix as a chain of text-level chunk hashes, scoped by its cache partition.

The gateway has no tokenizer, so a prefix is matched on the request's own input, not on
tokens: the prompt (text, token ids, or the chat messages in a canonical form) is cut into
``CHUNK_CHARS``-character chunks and each chunk's hash chains every chunk before it, rooted
in the request's prefix-cache partition (``protocol.tenants.cache_scope``) and its model
name (a LoRA adapter is a model name). Two requests share chunk ``k``'s hash exactly when
their inputs agree on the first ``k + 1`` chunks *and* they could share cached blocks; a
tenant's request can therefore only ever match chunks that its own partition served. A
worker records the hashes of what it served and the producer of the next request computes
them the same way, from the same fields, with no tokenizer on either side.
"""

from __future__ import annotations

import hashlib
import json

from protocol.models import GenerateRequest
from protocol.tenants.cache_scope import cache_partition

CHUNK_CHARS = 256
"""Characters per chunk: about 64 tokens of English, a few KV blocks. Shorter chunks match
more finely and cost more hashes on the board."""

MAX_CHUNKS = 128
"""Chunks hashed per request (32k characters): past that, a prefix is matched on its head."""

_SEP_FIELD, _SEP_MESSAGE = "\x1f", "\x1e"


def canonical_text(request: GenerateRequest) -> str:
    """The request's input as one string whose prefixes follow the rendered prompt's: a
    conversation's next turn starts with the previous turn's text. Chat messages keep
    their order, each as role, content and tool calls; a separator no printable text holds
    ends each message, so a message's content never runs into the next one's role."""
    if request.prompt_token_ids is not None:
        return "t" + _SEP_FIELD + ",".join(map(str, request.prompt_token_ids))
    if request.prompt is not None:
        return "p" + _SEP_FIELD + request.prompt
    parts = ["m"]
    for message in request.messages or []:
        calls = json.dumps([c.model_dump(mode="json") for c in message.tool_calls],
                           sort_keys=True) if message.tool_calls else ""
        parts.append(_SEP_FIELD.join((message.role, message.content, calls,
                                      message.tool_call_id or "", message.name or "")))
    return _SEP_MESSAGE.join(parts) + _SEP_MESSAGE


def scope_of(request: GenerateRequest) -> str:
    """What roots the chain: the cache partition and the model (adapters never share)."""
    return json.dumps([cache_partition(request.tenant, request.cache_scope,
                                       request.cache_salt), request.model or ""])


def prefix_chunks(request: GenerateRequest) -> list[str]:
    """The chained hashes of the request's whole leading chunks, first chunk first (hex, 16
    characters each). Empty when the input is shorter than one chunk."""
    return text_chunks(canonical_text(request), scope_of(request))


def text_chunks(text: str, scope: str) -> list[str]:
    """``prefix_chunks`` of a request whose ``canonical_text`` is ``text`` and whose
    ``scope_of`` is ``scope`` (the worker also needs the text's length)."""
    digest = hashlib.blake2b(scope.encode(), digest_size=8).digest()
    out: list[str] = []
    for k in range(min(len(text) // CHUNK_CHARS, MAX_CHUNKS)):
        chunk = text[k * CHUNK_CHARS:(k + 1) * CHUNK_CHARS].encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(digest + chunk, digest_size=8).digest()
        out.append(digest.hex())
    return out
