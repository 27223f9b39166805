"""Incremental detokenization: UTF-8-safe text deltas and stop strings across tokens.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens)
and for tokenizers that merge spaces with their neighbours. We decode a short window of
recent tokens twice — with and without the new ones — and emit the difference, holding
it back while it ends in an incomplete character (U+FFFD). Stop strings are searched in
the text not yet emitted plus enough of the emitted tail to catch a stop string split
across steps; text that could still be the start of a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_WINDOW = 6  # tokens of left context when decoding a new token
PROMPT_CONTEXT = _WINDOW  # prompt tokens a detokenizer needs (the output side gets these)


@dataclass(frozen=True, slots=True)
class DetokenizerResult:  # frozen: a detokenizer may hand out the same one again
    text_delta: str
    stopped: bool  # a stop string matched: the request must finish now
    stop_str: str | None = None  # which one (vLLM's stop_reason)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        prior_output_ids: list[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self._prefix_offset = 0  # window start for the "before" decode
        self._read_offset = len(self._ids)  # tokens already turned into text
        self.text = ""  # all output text decoded so far
        self._emitted = 0  # characters of self.text already sent
        for token in prior_output_ids or []:
            self._decode_next(token)
        self._emitted = len(self.text)  # prior tokens were sent by whoever ran them

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still incomplete
        new_text = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > _WINDOW:  # keep the window short
            drop = self._prefix_offset - _WINDOW
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        self.text += new_text
        return new_text

    def step(self, token_id: int) -> DetokenizerResult:
        """Feed one sampled token; returns the text that may be sent now."""
        new_text = self._decode_next(token_id)
        if not new_text and not self._stop:
            return DetokenizerResult("", False)
        if self._stop:
            match = self._find_stop(len(new_text))
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include_stop else start
                self.text = self.text[:end]
                delta = self.text[self._emitted :]
                self._emitted = len(self.text)
                return DetokenizerResult(delta, True, stop)
        limit = len(self.text) - self._held_back()
        delta = self.text[self._emitted : limit] if limit > self._emitted else ""
        self._emitted = max(self._emitted, limit)
        return DetokenizerResult(delta, False)

    def flush(self) -> str:
        """Text held back (a possible stop-string prefix) once the request ends otherwise."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _find_stop(self, num_new_chars: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest match in the new text."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            lo = max(0, min(self._emitted, len(self.text) - num_new_chars) - len(stop) + 1)
            pos = self.text.find(stop, lo)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


class StreamingDetokenizer(IncrementalDetokenizer):
    """The same text as ``IncrementalDetokenizer`` through ``tokenizers``' ``DecodeStream``:
    one Rust decode per token instead of two (``rust_decode.RustDecoder.decode_stream``).

    ``DecodeStream`` runs the window algorithm above (decode from the last chunk's first
    token, emit the growth unless it ends in U+FFFD, then start over from the new chunk),
    so its state is ours: ``_ids`` mirrors its buffer (``_prefix_offset`` stays 0) and
    ``_read_offset`` its prefix index. Where it cannot follow ours exactly (a prompt tail
    that decodes to nothing whole, a decode whose text stops extending the last chunk's:
    it raises) this stream goes on with the two window decodes from the mirrored state,
    and back to ``DecodeStream`` at the next chunk they emit (``_resume``). (A prompt tail
    with no whole text could be followed with DecodeStream too, but it then decodes its
    buffer twice a token while nothing is emitted: no faster than the windows.)
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], **kw: Any) -> None:
        tail = list(prompt_token_ids[-_WINDOW:])
        stream = tokenizer.decode_stream(kw.get("skip_special_tokens", True))
        # Prime with the prompt tail: ours starts with it all read; so does DecodeStream
        # when the tail decodes to whole text (it emits it and starts over from there).
        self._stream = stream if not tail or stream.step(tokenizer.rust, tail) else None
        self._rust = tokenizer.rust
        super().__init__(tokenizer, tail, **kw)

    def _resume(self) -> None:
        """After a window emission the state is a whole chunk: hand it back to
        ``DecodeStream`` (primed with the chunk, it emits it and starts over from it)."""
        chunk = self._ids[self._prefix_offset:]
        stream = self._tok.decode_stream(self._skip)
        if stream.step(self._rust, chunk) is not None:
            self._stream = stream
            self._ids, self._prefix_offset, self._read_offset = chunk, 0, len(chunk)

    def _decode_next(self, token_id: int) -> str:
        if self._stream is None:
            new_text = super()._decode_next(token_id)
            if new_text:
                self._resume()
            return new_text
        try:
            new_text = self._stream.step(self._rust, token_id)
        except Exception:  # noqa: BLE001 - InvalidPrefix: the window decodes take over
            self._stream = None
            return super()._decode_next(token_id)
        self._ids.append(token_id)
        if new_text is None:
            return ""
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self.text += new_text
        return str(new_text)
