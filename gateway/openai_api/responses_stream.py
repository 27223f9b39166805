"""A streamed Response: chat deltas (``ToolStream``'s) -> the Responses API's events.

``response.created`` / ``in_progress`` open it; text opens a message item
(``output_item.added``, ``content_part.added``) and flows as ``output_text.delta``; each
call is a ``function_call`` item with its ``function_call_arguments.delta`` / ``.done``;
``response.completed`` (or ``incomplete``, cut by ``max_output_tokens``) closes it with
the whole Response and its usage. Every event carries ``sequence_number``.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.openai_api.responses import (
    call_item,
    call_status,
    envelope,
    message_item,
    new_id,
    text_part,
)
from gateway.sse import sse


class ResponsesStream:
    def __init__(self, body: dict[str, Any], resp_id: str) -> None:
        self.body = body
        self.id = resp_id
        self.created = time.time()
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._text: str | None = None  # the open message item's text so far
        self._call: dict[str, Any] | None = None  # the call being sent
        self._logprobs: list[dict[str, Any]] = []  # the open text's, sent with its deltas
        self._pending: list[dict[str, Any]] = []  # tokens' logprobs not yet in a delta

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = sse({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1
        return frame

    def _response(self, finish: str | None = None, prompt: int = 0,
                  completion: int = 0, cached: int = 0) -> dict[str, Any]:
        return envelope(self.body, self.id, list(self.output), self.created, finish,
                        prompt, completion, cached)

    def opening(self) -> bytes:
        return self.event("response.created", response=self._response()) + \
            self.event("response.in_progress", response=self._response())

    def add_logprobs(self, entries: list[dict[str, Any]]) -> None:
        """``include``'s logprobs of the tokens just generated: they go out with the next
        text delta (text held back while it could be a call carries them all at once),
        and whole with the text's ``done`` events; a call's tokens' are dropped."""
        self._pending += entries

    def feed(self, deltas: list[dict[str, Any]]) -> bytes:
        out = b""
        for delta in deltas:
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
        return out

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._text is None:
            self.output.append(message_item(new_id("msg"), "", "in_progress"))
            self._text = ""
            item = self.output[-1]
            out += self.event("response.output_item.added", output_index=len(self.output) - 1,
                               item=item)
            out += self.event("response.content_part.added", item_id=item["id"],
                               output_index=len(self.output) - 1, content_index=0,
                               part=text_part(""))
        self._text += text
        logprobs, self._pending = self._pending, []
        self._logprobs += logprobs
        return out + self.event("response.output_text.delta", item_id=self.output[-1]["id"],
                                 output_index=len(self.output) - 1, content_index=0,
                                 delta=text, logprobs=logprobs)

    def _close_text(self) -> bytes:
        if self._text is None:
            return b""
        index = len(self.output) - 1
        self._logprobs += self._pending
        logprobs, self._logprobs, self._pending = self._logprobs, [], []
        item = self.output[index] = message_item(self.output[index]["id"], self._text,
                                                 logprobs=logprobs)
        text, self._text = self._text, None
        return self.event("response.output_text.done", item_id=item["id"],
                           output_index=index, content_index=0, text=text,
                           logprobs=logprobs) + \
            self.event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=text_part(text, logprobs)) + \
            self.event("response.output_item.done", output_index=index, item=item)

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        out = self._close_text()
        self._pending = []  # a call's tokens: no text's logprobs
        function = call.get("function") or {}
        if "id" in call:  # a call's first delta: its item opens
            item = call_item(call["id"], function.get("name", ""), "", "in_progress")
            self.output.append(item)
            return out + self.event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=item)
        index = len(self.output) - 1
        item = self.output[index]
        arguments = function.get("arguments", "")
        done = call_item(item["call_id"], item["name"], arguments, call_status(arguments))
        self.output[index] = done
        return out + self.event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
            delta=arguments) + self.event(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index,
            name=item["name"], arguments=arguments) + self.event(
            "response.output_item.done", output_index=index, item=done)

    def closing(self, finish: str | None, prompt: int, completion: int,
                cached: int = 0) -> bytes:
        out = self._close_text()
        final = self._response(finish or "stop", prompt, completion, cached)
        kind = "response.incomplete" if final["status"] == "incomplete" \
            else "response.completed"
        return out + self.event(kind, response=final)
