"""A chat output with tools -> OpenAI's ``tool_calls``: whole, or as stream deltas.

The worker's grammar made the output either text (or the ``response_format`` answer) or
a list of well-formed calls (``protocol/structured/tool_syntax.py``), so reading it back is a parse,
not a guess. Streamed, an output is held only while its beginning could still open a
call; text then flows as ``content`` deltas, and each call goes out once it is complete:
a delta with its ``index``, ``id`` and ``name``, then its ``arguments`` (the fragments the
SDK's stream helpers concatenate). Ids are ``call_`` + 24 hex digits.
"""

from __future__ import annotations

import uuid
from typing import Any

from protocol.structured.tool_syntax import Call, complete_calls, might_be_calls, parse_calls


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_body(call: Call, call_id: str | None = None) -> dict[str, Any]:
    name, arguments = call
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def message_fields(text: str, names: tuple[str, ...], cut: bool = False) -> dict[str, Any]:
    """The assistant message's ``content`` and ``tool_calls`` for a whole output. ``cut``:
    ended by ``max_tokens`` or a stop string: the calls completed before the cut, then
    the one being written, with its ``arguments`` as far as they got; call markup never
    goes into ``content``."""
    parsed = parse_calls(text, set(names), cut) if names else None
    if parsed is None:
        return {"content": text}
    content, calls = parsed
    return {"content": content, "tool_calls": [call_body(c) for c in calls] or None}


class ToolStream:
    """One choice's streamed output -> chat deltas (``content`` or ``tool_calls``)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.mode: str | None = None  # None: undecided; "text"; "calls"
        self.sent = 0  # calls sent
        self.flushed = 0  # characters of the buffer sent as content (text mode)

    @property
    def has_calls(self) -> bool:
        return self.sent > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        if self.mode is None:
            if complete_calls(self.buffer, self.names) is not None and \
                    not self.buffer.startswith("{"):
                self.mode = "calls"
            elif not might_be_calls(self.buffer):
                self.mode = "text"
        if self.mode == "text":
            return self._text()
        if self.mode == "calls":
            return self._calls(complete_calls(self.buffer, self.names) or [])
        return []

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """At the choice's end: what is left (a whole list of calls, or the text).
        ``cut`` (``max_tokens``, a stop string): the call being written is sent as it
        got, never as text."""
        parsed = parse_calls(self.buffer, self.names, cut)
        if parsed is not None and self.mode != "text":
            return self._calls(parsed[1])
        if self.sent:  # calls already sent: what follows them is no text
            return []
        return self._text()

    def _text(self) -> list[dict[str, Any]]:
        out = self.buffer[self.flushed:]
        self.flushed = len(self.buffer)
        return [{"content": out}] if out else []

    def _calls(self, calls: list[Call]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for call in calls[self.sent:]:
            body = call_body(call)
            name, arguments = call
            deltas.append({"tool_calls": [{"index": self.sent, "id": body["id"],
                                           "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": self.sent,
                                           "function": {"arguments": arguments}}]})
            self.sent += 1
        return deltas
