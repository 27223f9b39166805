"""The non-streamed OpenAI body of one exchange (completions and chat), and the facts of
each prompt that both it and the stream chunks (``gateway/openai_api/format.py``) read.

An exchange may carry several requests (a prompt list: choice ``i`` of prompt ``p`` is
index ``p * n + i``); each request's first event brings its prompt's facts
(``prompt_tokens``, ``prompt_logprobs``, ``prompt_text``), which echo, usage and vLLM's
``prompt_logprobs`` field need.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.openai_api.logprobs import (
    CompletionLogprobs,
    chat_content,
    entries_of,
    merge,
    vllm_prompt_logprobs,
)
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.tool_output import message_fields
from gateway.openai_api.usage import summed, usage_body
from protocol.models import ChoiceResult, PromptLogprob, StopReason, TokenEvent, Usage


class PromptFacts:
    """What one request (one prompt of the exchange) has said so far."""

    def __init__(self) -> None:
        self.started = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self.prompt_text: str | None = None
        self.cached_tokens: int | None = None  # known from the terminal event's usage

    def learn(self, event: TokenEvent) -> bool:
        """Take the prompt's facts from its first event; True the first time."""
        first = not self.started
        self.started = True
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.prompt_text is not None:
            self.prompt_text = event.prompt_text
        if event.usage is not None:
            self.prompt_tokens = event.usage.prompt_tokens or self.prompt_tokens
            self.cached_tokens = event.usage.cached_tokens
        return first


class WholeResponse:
    """One exchange's fixed id, creation time, model and object kind, its prompts' facts,
    and its non-streamed body."""

    def __init__(self, request_id: str, model: str, shape: ResponseShape) -> None:
        self.shape = shape
        self.chat = shape.chat
        self.id = f"{'chatcmpl' if shape.chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if shape.chat else "text_completion"
        self._prompts = [PromptFacts() for _ in range(shape.prompts)]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _echo_text(self, p: int) -> str:
        if self.chat:
            return self.shape.chat_echo or ""
        if not self.shape.echo:
            return ""
        own = self.shape.echo_texts[p] if p < len(self.shape.echo_texts) else None
        return own if own is not None else self._prompts[p].prompt_text or ""

    def response(self, per_prompt: Sequence[Sequence[TokenEvent]]) -> dict[str, Any]:
        """The non-streamed response: every prompt's choices, usage summed."""
        choices: list[dict[str, Any]] = []
        prompt_total = completion_total = 0
        for p, events in enumerate(per_prompt):
            state = self._prompts[p]
            for event in events:
                state.learn(event)
            final = events[-1]
            usage = final.usage or Usage()
            prompt_total += usage.prompt_tokens
            completion_total += usage.completion_tokens if self.shape.generate else 0
            parts = [(c.index, *choice_content(c, events), (c.finish_reason, c.stop_reason))
                     for c in final.choices] if final.choices else \
                [(0, "".join(e.text for e in events), list(events),
                  (final.finish_reason, final.stop_reason))]
            choices += [self._choice(p, i, text, evs, *end) for i, text, evs, end in parts]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_body(prompt_total, completion_total,
                                   summed([s.cached_tokens for s in self._prompts]))
        if self.chat and self.shape.prompt_logprobs:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return body

    def _choice(self, p: int, i: int, text: str, events: Sequence[TokenEvent],
                reason: str | None, stop_reason: StopReason | None) -> dict[str, Any]:
        index = self.shape.index(p, i)
        echo = self._echo_text(p)
        if not self.shape.generate:
            text, events, reason, stop_reason = "", [], "length", None
        if self.chat:
            lp = chat_content(entries_of(events), self.shape.token_ids_as_text) \
                if any(e.logprobs is not None for e in events) else None
            message = {"role": "assistant", **message_fields(
                echo + text, self.shape.tools, cut_short(reason, stop_reason))}
            if message.get("tool_calls") and reason == "stop" and stop_reason is None:
                reason = "tool_calls"
            return {"index": index, "message": message,
                    "logprobs": lp, "finish_reason": reason, "stop_reason": stop_reason}
        choice = {"index": index, "text": echo + text,
                  "logprobs": self._completion_logprobs(p, events, echo, CompletionLogprobs(
                      self.shape.token_ids_as_text)),
                  "finish_reason": reason, "stop_reason": stop_reason}
        if self.shape.prompt_logprobs:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(p)
        return choice

    def _completion_logprobs(self, p: int, events: Sequence[TokenEvent], echo: str,
                             layout: CompletionLogprobs) -> dict[str, Any] | None:
        """Echo's prompt block (from offset 0), then the completion's (after the echo)."""
        prompt_block = None
        prompt_lps = self._prompts[p].prompt_logprobs
        if echo and prompt_lps is not None:
            prompt_block = layout.block(prompt_lps)
        layout.offset = len(echo)
        completion = layout.block(entries_of(events)) \
            if any(e.logprobs is not None for e in events) else None
        return merge(prompt_block, completion)

    def _vllm_prompt_logprobs(self, p: int) -> list[dict[str, Any] | None] | None:
        entries = self._prompts[p].prompt_logprobs
        return None if entries is None else \
            vllm_prompt_logprobs(entries, self.shape.token_ids_as_text)


def cut_short(reason: str | None, stop_reason: StopReason | None) -> bool:
    """Whether an output ended before its grammar did: ``max_tokens`` or a stop string."""
    return reason == "length" or stop_reason is not None


def choice_content(
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
