"""TokenEvents -> OpenAI response bodies and stream chunks (completions and chat).

Finish reasons outside OpenAI's vocabulary become errors: ``error`` maps by the worker's
``error_kind`` (invalid_request -> 400, e.g. a model without a chat template), ``timeout``
-> 504, ``abort`` -> 503 (retry), ``cancelled`` -> 499 (gRPC's CANCELLED over HTTP).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.errors import APIError
from gateway.sse import json_bytes, sse
from protocol.models import ChoiceResult, TokenEvent, TokenLogprob, Usage

_KIND_STATUS = {"invalid_request": 400, "internal": 500, "unavailable": 503}
_REASON_STATUS = {"timeout": 504, "abort": 503, "cancelled": 499}
_DEFAULT_MESSAGES = {
    "error": "the worker failed to run the request",
    "timeout": "the request timed out",
    "abort": "the request was aborted by the worker; retry",
    "cancelled": "the request was cancelled",
}


def failure(event: TokenEvent) -> APIError | None:
    """The HTTP error a terminal event stands for, or None for stop/length."""
    reason = event.finish_reason
    if reason in (None, "stop", "length"):
        return None
    if reason == "error":
        status = _KIND_STATUS.get(event.error_kind or "internal", 500)
    else:
        status = _REASON_STATUS[reason]
    message = event.error or _DEFAULT_MESSAGES[reason]
    type_ = "invalid_request_error" if status == 400 else None
    return APIError(status, message, type_=type_)


def usage_body(usage: Usage | None) -> dict[str, int]:
    usage = usage or Usage()
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _token_text(lp: TokenLogprob | Any) -> str:
    return lp.token if lp.token is not None else f"token_id:{lp.token_id}"


def completion_logprobs(events: Sequence[TokenEvent], offset: int = 0) -> dict[str, Any] | None:
    """Legacy completions layout: parallel lists, top logprobs as {token: logprob}."""
    entries = [lp for e in events for lp in (e.logprobs or [])]
    if not any(e.logprobs is not None for e in events):
        return None
    tokens = [_token_text(lp) for lp in entries]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{_token_text(t): t.logprob for t in lp.top} for lp in entries],
        "text_offset": offsets,
    }


def chat_logprobs(events: Sequence[TokenEvent]) -> dict[str, Any] | None:
    """Chat layout: one entry per token with its bytes and its top alternatives."""
    if not any(e.logprobs is not None for e in events):
        return None

    def entry(lp: Any) -> dict[str, Any]:
        text = _token_text(lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = [
        {**entry(lp), "top_logprobs": [entry(t) for t in lp.top]}
        for e in events for lp in (e.logprobs or [])
    ]
    return {"content": content}


def _choice_content(
    choice: ChoiceResult, events: Sequence[TokenEvent]
) -> tuple[str, list[TokenEvent]]:
    """A choice's text and its logprobs as pseudo-events: from the terminal event's
    choice when it carries them (not streamed), else from the events of its index."""
    if choice.text is not None:
        pseudo = TokenEvent(request_id=events[-1].request_id, seq=0, index=choice.index,
                            logprobs=choice.logprobs)
        return choice.text, [pseudo]
    own = [e for e in events if e.index == choice.index]
    return "".join(e.text for e in own), own


_SLOT = "\x00ferry-text-slot\x00"


class Formatter:
    """Builds bodies for one request: fixed id, creation time, model and object kind.

    Stream chunks that carry only text (nearly all of them) are the same bytes but for
    the text: ``text_frame`` encodes everything around it once per choice index, so each
    token costs one JSON string encoding and a concatenation."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int = 1) -> None:
        self.chat = chat
        self.n = n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self._frames: dict[int, tuple[bytes, bytes]] = {}
        self._finished: set[int] = set()  # choices whose finish chunk was sent

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, events: Sequence[TokenEvent]) -> dict[str, Any]:
        """The whole non-streamed response, one choice per index."""
        final = events[-1]
        if final.choices:  # n > 1: the terminal event lists them (with their content)
            parts = [(c.index, *_choice_content(c, events), c.finish_reason)
                     for c in final.choices]
        else:
            parts = [(0, "".join(e.text for e in events), list(events), final.finish_reason)]
        choices = [self._choice(index, text, evs, reason) for index, text, evs, reason in parts]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_body(final.usage)
        return body

    def _choice(self, index: int, text: str, events: Sequence[TokenEvent],
                reason: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": chat_logprobs(events), "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": completion_logprobs(events),
                "finish_reason": reason}

    def finish_frame(self, index: int, reason: str | None) -> bytes:
        """The chunk closing one choice (sent once per choice)."""
        self._finished.add(index)
        return sse(self.chunk(None, finish_reason=reason, index=index))

    def close_open_choices(self, final: TokenEvent) -> list[bytes]:
        """At the terminal event: finish chunks for every choice not closed yet."""
        reasons = {c.index: c.finish_reason for c in final.choices or []}
        return [self.finish_frame(i, reasons.get(i, final.finish_reason))
                for i in range(self.n) if i not in self._finished]

    def chunk(self, event: TokenEvent | None, first: bool = False,
              finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
        """One stream chunk: text of ``event`` (if any), or the closing finish_reason."""
        events = [event] if event is not None else []
        return self._chunk(event.text if event is not None else "", event is not None, events,
                           first, finish_reason, index)

    def _chunk(self, text: str, has_event: bool, events: list[TokenEvent], first: bool,
               finish_reason: str | None, index: int) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                {"content": text} if has_event else {})
            choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(events),
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": completion_logprobs(events),
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def text_frame(self, text: str, index: int = 0) -> bytes:
        """The framed SSE message of a chunk carrying only ``text`` (no logprobs): the
        same JSON as ``sse(chunk(event))``, from pre-encoded parts."""
        frame = self._frames.get(index)
        if frame is None:
            parts = sse(self._chunk(_SLOT, True, [], False, None, index)).split(
                json_bytes(_SLOT))
            if len(parts) != 2:  # a model name holding the slot marker: no shortcut
                return sse(self._chunk(text, True, [], False, None, index))
            frame = self._frames[index] = (parts[0], parts[1])
        return frame[0] + json_bytes(text) + frame[1]

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_body(usage)}
