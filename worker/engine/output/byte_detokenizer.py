"""Byte-level BPE detokenizing from a token -> bytes table: no decode of a growing buffer.

For a tokenizer whose decoder is ``ByteLevel`` (GPT-2, Llama 3, Qwen, the default
model), ``tokenizers``' ``decode(ids)`` is a pure function of the token bytes: each token
maps to bytes on its own (its characters through GPT-2's byte table, or its UTF-8 when a
character is not in it; a special token dropped with ``skip_special_tokens``), and the
joined bytes become text with ``String::from_utf8_lossy``. ``DecodeStream`` and the window
decodes (``detokenizer.py``) decode a buffer that grows with every token until a chunk is
emitted; for bytes that never make a whole character (the stub model's, or a model that
babbles) each token costs more than the last.

Both emit, token by token, what the window rule gives: with W the last chunk's bytes and
N those since, ``after = lossy(W + N)``, ``before = lossy(W)``; emit ``after[len(before):]``
when it is longer and does not end in U+FFFD. UTF-8 decoding restarts at every byte that
is not a continuation byte (0x80-0xBF), whatever came before it (Python's ``decode("utf-8",
"replace")`` and Rust's ``from_utf8_lossy`` both replace each maximal ill-formed subpart
with one U+FFFD, the Unicode recommendation). So with T the bytes of W from its last such
byte (at most four; none when W ends on a whole character, as every emitted chunk does),
``after = lossy(W - T) + lossy(T + N)``: the delta is ``lossy(T + N)[len(lossy(T)):]``,
whether it ends in U+FFFD is read off the last four bytes, and T + N is decoded only when
it ends on a whole character: a token costs a table look-up and a few byte tests, and N is
decoded about once. ``rust_decode.byte_pieces`` checks the table against the tokenizer's own decode
before anything uses it; the tests compare the deltas with ``DecodeStream``'s and the
window decodes' over random byte soup, real text, stop strings and resumed requests.
"""

from __future__ import annotations

from typing import Any

from worker.engine.output.detokenizer import (
    _WINDOW,
    DetokenizerResult,
    IncrementalDetokenizer,
    StreamingDetokenizer,
)
from worker.engine.output.rust_decode import RustDecoder, TokenBytes

_NOTHING = DetokenizerResult("", False)  # frozen: one for every token that emits nothing


def ends_in_replacement(buf: bytes | bytearray) -> bool:
    """Whether ``buf.decode("utf-8", "replace")`` ends with U+FFFD (a character not yet
    whole, bytes that never make one, or U+FFFD itself), from its last four bytes."""
    n = len(buf)
    for k in range(n - 1, max(n - 5, -1), -1):
        if not 0x80 <= buf[k] <= 0xBF:  # decoding restarts here, whatever came before
            return buf[k:].decode("utf-8", "replace")[-1] == "\ufffd"
    return True  # four continuation bytes at the end: the last belongs to no character


def _tail_from_restart(window: bytes) -> bytes:
    """T: the window's bytes from the last byte where decoding restarts (in its last four),
    when they end inside a character; empty when the window ends on a whole one."""
    n = len(window)
    for k in range(n - 1, max(n - 5, -1), -1):
        if not 0x80 <= window[k] <= 0xBF:
            tail = window[k:]
            return tail if tail.decode("utf-8", "replace")[-1] == "\ufffd" else b""
    return b""  # the last byte belongs to no character: decoding is back at its start


class ByteDetokenizer(IncrementalDetokenizer):
    """``IncrementalDetokenizer``'s (and so ``StreamingDetokenizer``'s) text and deltas from
    the tokenizer's ``byte_pieces``: the window's undecided tail T (``_tail``, whose text
    is ``_tail_len`` characters long) and the bytes since the last chunk N (``_pending``).
    Without stop strings ``text`` is not kept (nothing reads it then: every delta is sent
    at once, so ``flush`` has nothing left), so a token costs no copy of the text so far."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], **kw: Any) -> None:
        table: TokenBytes = tokenizer.byte_pieces[kw.get("skip_special_tokens", True)]
        self._table, self._whole, self._results = table
        self._pending = bytearray()
        tail = list(prompt_token_ids[-_WINDOW:])
        self._tail = _tail_from_restart(self._join(tail))
        self._tail_len = len(self._tail.decode("utf-8", "replace"))
        super().__init__(tokenizer, tail, **kw)

    def _join(self, ids: list[int]) -> bytes:
        table, size = self._table, len(self._table)
        return b"".join([table[i] if i < size else b"" for i in ids])

    def _next_bytes(self, token_id: int) -> str:
        """The delta of one more token (ids are the engine's: never negative; one past
        the vocabulary decodes to nothing, as ``tokenizers`` drops it)."""
        pending, tail = self._pending, self._tail
        pending += self._table[token_id] if token_id < len(self._table) else b""
        if not pending:
            return ""  # no bytes yet (a skipped special token): the same text as before
        if pending[-1] >= 0x80 and ends_in_replacement(
                tail + pending if tail and len(pending) < 4 else pending):
            return ""
        text = (tail + pending if tail else pending).decode("utf-8", "replace")
        skip = self._tail_len
        if len(text) <= skip:
            return ""
        pending.clear()  # the chunk ends on a whole character: no tail to carry
        self._tail, self._tail_len = b"", 0
        return text[skip:] if skip else text

    def _decode_next(self, token_id: int) -> str:
        new_text = self._next_bytes(token_id)
        self.text += new_text
        return new_text

    def step(self, token_id: int) -> DetokenizerResult:
        if self._stop:
            return super().step(token_id)
        if not self._pending and not self._tail:  # at a chunk's start: a whole token?
            result = self._results.get(token_id)
            if result is not None:
                return result
            text = self._whole[token_id] if token_id < len(self._whole) else None
            if text is not None:
                result = self._results[token_id] = DetokenizerResult(text, False)
                return result
        new_text = self._next_bytes(token_id)
        return DetokenizerResult(new_text, False) if new_text else _NOTHING


def make_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], *, stop: list[str] | None = None,
    include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
    prior_output_ids: list[int] | None = None,
) -> IncrementalDetokenizer:
    """The detokenizer of one stream (the output side's single way to build one): the
    byte-table one where the tokenizer has a table (``ByteDetokenizer``), else the
    ``DecodeStream`` one where it offers that (same text, one decode a token)."""
    cls: type[IncrementalDetokenizer] = IncrementalDetokenizer
    if isinstance(tokenizer, RustDecoder) and tokenizer.streams:
        cls = ByteDetokenizer if tokenizer.byte_pieces is not None else StreamingDetokenizer
    return cls(
        tokenizer, prompt_token_ids, stop=stop,
        include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens, prior_output_ids=prior_output_ids,
    )
