"""Token ids -> text: the output side of a step, in-process.

``StreamTexts`` turns ``StepBatch``es into the per-request ``TextOutput``s (text deltas,
stop strings, usage) that the engine produced itself before it emitted token ids only. It
needs a tokenizer and nothing of the engine, so the worker's output process runs the same
code (``worker/service/output_proc/process.py``). ``TextOutputs`` binds it to an in-process
engine for ``LLM``, ``ferry generate`` and tests: a stop string ends the request at once
(``Engine.finish_stream``), at the step whose token completed it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from worker.engine.output.byte_detokenizer import make_detokenizer
from worker.engine.output.outputs import TextOutput
from worker.engine.output.rust_decode import decode_spec, text_decoder
from worker.engine.output.step_batch import EngineEnd, StepBatch, StreamOpen

if TYPE_CHECKING:
    from worker.engine.request import FinishReason


class StepSource(Protocol):
    """What ``TextOutputs`` drives: an in-process engine (``worker.engine.engine.Engine``),
    named by what it uses so that this room imports nothing above it."""

    tokenizer: Any
    streams: Any  # StreamRegistry

    def step(self) -> StepBatch: ...

    def abort(self, request_id: str, reason: FinishReason = ...) -> list[EngineEnd]: ...

    def finish_stream(self, stream: int, reason: str = ...,
                      stop_reason: str | int | None = ...) -> EngineEnd | None: ...


@dataclass(slots=True)
class _Stream:
    open: StreamOpen
    detok: Any
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (StepBatch.cached)


# Called when a stop string ends a stream: (stream, stop string) -> the engine's end, if
# it can answer at once (in-process), else None (the output process: one step late).
StopHook = Callable[[int, str], EngineEnd | None]


class StreamTexts:
    """The detokenizers of the open streams; one batch in, its outputs out."""

    def __init__(self, tokenizer: Any, on_stop: StopHook) -> None:
        self._tok = tokenizer
        self._on_stop = on_stop
        self.streams: dict[int, _Stream] = {}
        self.tokens_seen = 0
        self.rows_dropped = 0  # rows of streams already ended here (the stop-string step)

    def open(self, opened: list[StreamOpen]) -> None:
        for o in opened:
            detok = make_detokenizer(
                self._tok, o.prompt_tail, stop=o.stop,
                include_stop_str_in_output=o.include_stop_str_in_output,
                skip_special_tokens=o.skip_special_tokens, prior_output_ids=o.prior_output_ids,
            )
            self.streams[o.stream] = _Stream(o, detok, len(o.prior_output_ids))

    def apply(self, batch: StepBatch) -> list[TextOutput]:
        """The batch's outputs: one per row (final with its request's end), then the ends
        that came without a token. Rows of a stream already ended here (a stop string
        found a step before the engine heard of it) are dropped: never published."""
        self.open(batch.opened)
        for stream, cached in batch.cached.items():
            if stream in self.streams:
                self.streams[stream].num_cached_tokens = cached
        at_row = {end.row: end for end in batch.ends if end.row >= 0}
        outputs: list[TextOutput] = []
        append, streams, lps = outputs.append, self.streams, batch.logprobs
        prompt_lps = batch.prompt_logprobs or None  # most batches have none: no look-up
        seen = 0
        for row, (stream, token) in enumerate(zip(batch.streams, batch.token_ids, strict=True)):
            s = streams.get(stream)
            if s is None:
                self.rows_dropped += 1
                continue
            seen += 1
            s.num_output_tokens += 1
            lp = lps[row] if lps is not None else None
            result = s.detok.step(token)
            end = at_row.get(row) if at_row else None
            if end is None and result.stopped:
                end = self._on_stop(stream, result.stop_str)
                if end is None:  # the engine hears of it later; this stream is done here
                    end = _stop_end(s, result.stop_str)
            if end is not None:
                append(self._final(end, [token], result.text_delta, lp))
                continue
            o = s.open
            append(TextOutput(
                o.request_id, [token], result.text_delta,
                num_prompt_tokens=o.num_prompt_tokens, num_output_tokens=s.num_output_tokens,
                logprobs=[lp] if lp is not None else None, index=o.index,
                prompt_logprobs=prompt_lps.get(stream) if prompt_lps else None,
            ))
        self.tokens_seen += seen
        outputs += [self._final(end, [], "") for end in batch.ends
                    if end.row < 0 and end.stream in self.streams]
        return outputs

    def ends(self, ends: list[EngineEnd]) -> list[TextOutput]:
        """Final outputs of ends that came outside a step (an abort)."""
        return [self._final(end, [], "") for end in ends if end.stream in self.streams]

    def abort(self, request_id: str) -> list[TextOutput]:
        """The final outputs of a request's streams still open here, ended as the engine's
        ``abort`` ends them: the output process's view of an abort the engine makes after
        this batch (its own ends then find these streams closed and are dropped)."""
        mine = [s for s in self.streams.values() if s.open.request_id == request_id]
        return self.ends([EngineEnd(s.open.stream, "abort", None, None,
                                    s.open.num_prompt_tokens, s.num_output_tokens)
                          for s in mine])

    def _final(
        self, end: EngineEnd, tokens: list[int], text: str, lp: Any = None
    ) -> TextOutput:
        s = self.streams.pop(end.stream)
        if end.finish_reason != "stop":
            text += s.detok.flush()
        return TextOutput(
            s.open.request_id, tokens, text, finished=True,
            finish_reason=end.finish_reason, error=end.error, stop_reason=end.stop_reason,
            num_prompt_tokens=end.num_prompt_tokens, num_output_tokens=end.num_output_tokens,
            logprobs=[lp] if lp is not None else None, error_kind=end.error_kind,
            index=s.open.index, cumulative_logprob=end.cumulative_logprob,
            prompt_logprobs=end.prompt_logprobs, num_cached_tokens=s.num_cached_tokens,
        )


def _stop_end(s: _Stream, stop_str: str | None) -> EngineEnd:
    """The end of a stream a stop string finished here, before the engine knows."""
    return EngineEnd(s.open.stream, "stop", stop_str, None, s.open.num_prompt_tokens,
                     s.num_output_tokens)


class TextOutputs:
    """An in-process engine's steps as text outputs (``LLM``, ``ferry generate``, tests)."""

    _bound: weakref.WeakKeyDictionary[StepSource, TextOutputs] = weakref.WeakKeyDictionary()

    def __init__(self, engine: StepSource) -> None:
        self.engine = engine
        self.texts = StreamTexts(
            text_decoder(decode_spec(engine.tokenizer), lambda: engine.tokenizer), self._stop)

    @classmethod
    def of(cls, engine: StepSource) -> TextOutputs:
        """The one adapter of ``engine`` (its streams' detokenizers live there)."""
        bound = cls._bound.get(engine)
        if bound is None:
            bound = cls._bound[engine] = cls(engine)
        return bound

    def _stop(self, stream: int, stop_str: str) -> EngineEnd | None:
        return self.engine.finish_stream(stream, "stop", stop_str)

    def step(self) -> list[TextOutput]:
        return self.texts.apply(self.engine.step())

    def abort(self, request_id: str, reason: FinishReason | None = None) -> list[TextOutput]:
        ends = self.engine.abort(request_id) if reason is None else \
            self.engine.abort(request_id, reason)
        self.texts.open(self.engine.streams.take_opened())
        return self.texts.ends(ends)
