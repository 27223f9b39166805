"""TokenEvents -> OpenAI stream chunks (completions and chat), on top of the whole body.

One ``Formatter`` serves one HTTP exchange: it is a ``WholeResponse``
(``gateway/openai_api/whole_response.py``: the exchange's prompts' facts and its
non-streamed body) that also frames the SSE chunks of a streamed one: the role and echo
openings, token chunks, per-choice finish chunks and the usage chunk.

Terminal events that are failures become HTTP errors (``gateway.errors.failure``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.errors import APIError, failure
from gateway.openai_api.logprobs import CompletionLogprobs, chat_content
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.tool_output import ToolStream
from gateway.openai_api.usage import summed, usage_body
from gateway.openai_api.whole_response import WholeResponse, cut_short
from gateway.sse import json_bytes, sse
from protocol.models import StopReason, TokenEvent

_SLOT = "\x00ferry-text-slot\x00"


class Formatter(WholeResponse):
    """Builds the bodies and stream chunks of one exchange.

    Stream chunks that carry only text (nearly all of them) are the same bytes but for
    the text: ``text_frame`` encodes everything around it once per choice index, so each
    token costs one JSON string encoding and a concatenation."""

    def __init__(self, request_id: str, model: str, shape: ResponseShape) -> None:
        super().__init__(request_id, model, shape)
        self._frames: dict[int, tuple[bytes, bytes]] = {}
        self._finished: set[int] = set()  # choices whose finish chunk was sent
        self._logprobs: dict[int, CompletionLogprobs] = {}
        self._tools: dict[int, ToolStream] = {}  # chat with tools: per choice index

    def opening(self) -> bytes:
        """Chat: the role chunk of every choice, then the echoed content, if any."""
        if not self.chat:
            return b""
        frames = [sse(self._chunk(i, {"role": "assistant", "content": ""}))
                  for i in range(self.shape.choices)]
        if self.shape.chat_echo:
            frames += [sse(self._chunk(i, {"content": self.shape.chat_echo}))
                       for i in range(self.shape.choices)]
        return b"".join(frames)

    def frames(self, p: int, events: Sequence[TokenEvent]) -> tuple[bytes, APIError | None]:
        """The SSE messages of prompt ``p``'s events, as one write; the error that ends
        the exchange, if one of them is a failed terminal event."""
        parts: list[bytes] = []
        state = self._prompts[p]
        for event in events:
            if not state.started:
                state.learn(event)
                parts += self._echo_frames(p)
            state.completion_tokens += len(event.token_ids)
            index = self.shape.index(p, event.index)
            if self.chat and self.shape.tools and event.text:
                parts += [sse(self._chunk(index, d)) for d in self._tool(index).feed(event.text)]
            elif (event.text or event.logprobs) and self.shape.generate:
                parts.append(self._token_frame(p, index, event))
            if event.choice_finish_reason is not None:
                parts.append(self.finish_frame(p, index, event.choice_finish_reason,
                                               event.stop_reason))
            if event.finish_reason is None:
                continue
            error = failure(event)
            if error is not None:
                return b"".join(parts), error
            parts += self._close_prompt(p, event)
        return b"".join(parts), None

    def _echo_frames(self, p: int) -> list[bytes]:
        """Completions echo: each choice of prompt ``p`` starts with the prompt's text
        (and, if asked, its tokens' logprobs)."""
        echo = self._echo_text(p)
        if self.chat or not echo:
            return []
        frames = []
        for i in range(self.shape.n):
            index = self.shape.index(p, i)
            layout = self._layout(index)
            lps = self._prompts[p].prompt_logprobs
            choice = {"index": index, "text": echo, "finish_reason": None,
                      "logprobs": layout.block(lps) if lps is not None else None}
            layout.offset = len(echo)
            frames.append(sse(self._with_usage(p, self._envelope(self.obj, [choice]))))
        return frames

    def _layout(self, index: int) -> CompletionLogprobs:
        if index not in self._logprobs:
            self._logprobs[index] = CompletionLogprobs(self.shape.token_ids_as_text)
        return self._logprobs[index]

    def _token_frame(self, p: int, index: int, event: TokenEvent) -> bytes:
        if event.logprobs is None and not self.shape.continuous_usage:
            return self.text_frame(event.text, index)
        if self.chat:
            lp = chat_content(event.logprobs or [], self.shape.token_ids_as_text) \
                if event.logprobs is not None else None
            chunk = self._chunk(index, {"content": event.text}, logprobs=lp)
        else:
            lp = self._layout(index).block(event.logprobs) if event.logprobs is not None \
                else None
            chunk = self._chunk(index, None, text=event.text, logprobs=lp)
        return sse(self._with_usage(p, chunk))

    def _with_usage(self, p: int, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.shape.continuous_usage:
            state = self._prompts[p]
            chunk["usage"] = usage_body(state.prompt_tokens, state.completion_tokens
                                        if self.shape.generate else 0, state.cached_tokens)
        return chunk

    def finish_frame(self, p: int, index: int, reason: str | None,
                     stop_reason: StopReason | None = None) -> bytes:
        """The chunk closing one choice (sent once per choice), with vLLM's
        ``stop_reason``: the stop string or stop token id, else null."""
        self._finished.add(index)
        if not self.shape.generate:
            reason, stop_reason = "length", None
        delta: dict[str, Any] | None = {} if self.chat else None
        rest = b""
        if index in self._tools:  # tools: what was held back, then the reason
            tools = self._tools[index]
            rest = b"".join(sse(self._chunk(index, d))
                            for d in tools.finish(cut_short(reason, stop_reason)))
            if tools.has_calls and reason == "stop" and stop_reason is None:
                reason = "tool_calls"
        chunk = self._chunk(index, delta, finish_reason=reason)
        chunk["choices"][0]["stop_reason"] = stop_reason
        return rest + sse(self._with_usage(p, chunk))

    def _tool(self, index: int) -> ToolStream:
        if index not in self._tools:
            self._tools[index] = ToolStream(self.shape.tools)
        return self._tools[index]

    def _close_prompt(self, p: int, final: TokenEvent) -> list[bytes]:
        """At prompt ``p``'s terminal event: finish chunks for its choices still open."""
        state = self._prompts[p]
        if final.usage is not None:
            state.prompt_tokens = final.usage.prompt_tokens or state.prompt_tokens
            state.completion_tokens = final.usage.completion_tokens
            state.cached_tokens = final.usage.cached_tokens
        ends = {c.index: (c.finish_reason, c.stop_reason) for c in final.choices or []}
        return [self.finish_frame(p, self.shape.index(p, i),
                                  *ends.get(i, (final.finish_reason, final.stop_reason)))
                for i in range(self.shape.n) if self.shape.index(p, i) not in self._finished]

    def _chunk(self, index: int, delta: dict[str, Any] | None, text: str = "",
               logprobs: Any = None, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta or {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return self._envelope(self.obj, [choice])

    def text_frame(self, text: str, index: int = 0) -> bytes:
        """The framed SSE message of a chunk carrying only ``text`` (no logprobs): the
        same JSON as the slow path, from pre-encoded parts."""
        frame = self._frames.get(index)
        if frame is None:
            chunk = self._chunk(index, {"content": _SLOT}, text=_SLOT)
            parts = sse(chunk).split(json_bytes(_SLOT))
            if len(parts) != 2:  # a model name holding the slot marker: no shortcut
                return sse(self._chunk(index, {"content": text}, text=text))
            frame = self._frames[index] = (parts[0], parts[1])
        return frame[0] + json_bytes(text) + frame[1]

    def usage_chunk(self) -> bytes:
        """``include_usage``: the last chunk, usage summed over every prompt."""
        prompt = sum(s.prompt_tokens for s in self._prompts)
        completion = sum(s.completion_tokens for s in self._prompts) \
            if self.shape.generate else 0
        cached = summed([s.cached_tokens for s in self._prompts])
        return sse({**self._envelope(self.obj, []),
                    "usage": usage_body(prompt, completion, cached)})
