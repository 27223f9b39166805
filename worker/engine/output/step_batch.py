"""What ``Engine.step()`` hands back: token ids, nothing else.

One compact ``StepBatch`` per step: the streams opened since the last batch (what an
output side needs to detokenize them), one row per sampled token (stream id, token id,
logprobs when asked) and the ``EngineEnd`` of every request that ended. No text, no
per-request objects: detokenizing, stop strings and events happen on the output side
(``text_output.py`` in-process, ``worker/service/output_proc/process.py`` in a process of its
own). Streams are small ints (``StreamRegistry``) so a batch packs into a few lists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from worker.engine.output.detokenizer import PROMPT_CONTEXT
from worker.engine.request import Request

# Per token: (logprob of the token, [(token id, logprob), ...top-n]).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class StreamOpen:
    """A stream's fixed facts, sent once before its first row or end."""

    stream: int
    request_id: str  # the public id (the parent's, for one of several candidates)
    index: int  # which candidate
    prompt_tail: list[int]  # the prompt's last tokens: the detokenizer's left context
    prior_output_ids: list[int]  # a resumed request's tokens already sent elsewhere
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    num_prompt_tokens: int

    @classmethod
    def of(cls, stream: int, request: Request) -> StreamOpen:
        params = request.params
        return cls(
            stream, request.public_id, request.index,
            list(request.prompt_token_ids[-PROMPT_CONTEXT:]), list(request.output_token_ids),
            list(params.stop or []), params.include_stop_str_in_output,
            params.skip_special_tokens, request.num_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class EngineEnd:
    """A request that ended in the engine (finished, aborted, failed)."""

    stream: int
    finish_reason: str
    stop_reason: str | int | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    row: int = -1  # the row of its last token in the batch, -1 when it ended without one
    error_kind: str | None = None  # "invalid_request" when the request is at fault
    cumulative_logprob: float | None = None  # on a ranked candidate
    # still unsent ones (worker/engine/sample/prompt_logprobs.py)
    prompt_logprobs: list[Any] | None = None


@dataclass(slots=True)
class StepBatch:
    opened: list[StreamOpen] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)  # [rows]
    token_ids: list[int] = field(default_factory=list)  # [rows]
    logprobs: list[TokenLogprob | None] | None = None  # [rows] when any row asked
    prompt_logprobs: dict[int, list[Any]] = field(default_factory=dict)  # on a first row
    ends: list[EngineEnd] = field(default_factory=list)
    # Streams first scheduled in this step -> their prompt tokens served from the prefix
    # cache (``Request.num_cached_tokens``): the usage their terminal output reports
    cached: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def is_empty(self) -> bool:
        return not (self.opened or self.streams or self.ends or self.cached)

    def add_row(self, stream: int, token: int, lp: TokenLogprob | None) -> int:
        if lp is not None and self.logprobs is None:
            self.logprobs = [None] * len(self.streams)
        if self.logprobs is not None:
            self.logprobs.append(lp)
        self.streams.append(stream)
        self.token_ids.append(token)
        return len(self.streams) - 1

    def extend_ends(self, ends: list[EngineEnd]) -> StepBatch:
        self.ends += ends
        return self


class StreamRegistry:
    """Small int stream ids for the requests the engine holds; never reused, so a late row
    or a late ``finish_stream`` can never reach another request."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}
        self.by_request: dict[str, int] = {}
        self._opened: list[StreamOpen] = []

    def open(self, request: Request) -> int:
        stream = next(self._ids)
        self.requests[stream] = request
        self.by_request[request.request_id] = stream
        self._opened.append(StreamOpen.of(stream, request))
        return stream

    def stream_of(self, request: Request) -> int:
        return self.by_request[request.request_id]

    def close(self, request: Request) -> int:
        stream = self.by_request.pop(request.request_id)
        del self.requests[stream]
        return stream

    def cached_of(self, requests: list[Request]) -> dict[int, int]:
        """Each open stream's ``num_cached_tokens``, for requests just first scheduled."""
        by_request = self.by_request
        return {by_request[r.request_id]: r.num_cached_tokens for r in requests
                if r.request_id in by_request}

    def take_opened(self) -> list[StreamOpen]:
        opened, self._opened = self._opened, []
        return opened
