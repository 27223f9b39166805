"""Byte-level BPE detokenizing from a token -> bytes table: no decode of a growing buffer.

For a tokenizer whose decoder is ``ByteLevel`` (GPT-2, Llama 3, Qwen, the default
model), ``tokenizers``' ``decode(ids)`` is a pure function of the token bytes: each token
maps to bytes on its own (its characters through GPT-2's byte table, or its UTF-8 when a
character is not in it; a special token dropped with ``skip_special_tokens``), and the
joined bytes become text with ``String::from_utf8_lossy``. ``DecodeStream`` re-decodes its
whole buffer every token, which for bytes that never make a whole character (the stub
model's, or a model that babbles) costs more with each token.

What ``DecodeStream`` emits there, token by token, is a function of the bytes since its
last emission alone (call them N): it emits ``lossy(N)`` once N is non-empty and
``lossy(N)`` does not end in U+FFFD, then starts over. (Its buffer is the last chunk P
plus N; an emission leaves ``lossy(P)`` ending in a whole character, where UTF-8 decoding
is back at its start state, so ``lossy(P + N) == lossy(P) + lossy(N)``: the growth is
``lossy(N)``, never an ``InvalidPrefix``.) Whether ``lossy(N)`` ends in U+FFFD is read off
its last four bytes, since decoding restarts at every byte that is not a continuation
byte (0x80-0xBF): a token costs a table look-up and a few byte tests, and N is decoded
once, when it is emitted. Python's ``decode("utf-8", "replace")`` and Rust's
``from_utf8_lossy`` both replace each maximal ill-formed subpart with one U+FFFD (the
Unicode recommendation); ``byte_pieces`` checks the table against the tokenizer's own
decode before anything uses it, and the tests compare with ``DecodeStream`` and the window
decodes over random byte soup.
"""

from __future__ import annotations

import random
from typing import Any

from worker.engine.detokenizer import _WINDOW, DetokenizerResult, IncrementalDetokenizer

_NOTHING = DetokenizerResult("", False)  # never mutated by its readers


def gpt2_byte_chars() -> dict[str, int]:
    """GPT-2's printable character -> byte table (``ByteLevel``'s ``CHAR_BYTES``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def byte_pieces(rust: Any, data: dict[str, Any]) -> dict[bool, list[bytes]] | None:
    """Each id's bytes, per ``skip_special_tokens``, for a ``ByteLevel``-decoded tokenizer
    (``rust``: a ``tokenizers.Tokenizer``; ``data``: its JSON); None when the decoder is
    anything else or the table disagrees with ``rust.decode`` (then ``DecodeStream``)."""
    decoder = data.get("decoder")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return None
    chars = gpt2_byte_chars()
    special = {t["content"] for t in data.get("added_tokens") or [] if t.get("special")}
    size = max([rust.get_vocab_size(with_added_tokens=True)]
               + [t["id"] + 1 for t in data.get("added_tokens") or []])
    tables: dict[bool, list[bytes]] = {}
    for skip in (False, True):
        table = []
        for i in range(size):
            token = rust.id_to_token(i)
            if token is None or (skip and token in special):
                table.append(b"")
            elif all(c in chars for c in token):
                table.append(bytes(chars[c] for c in token))
            else:
                table.append(token.encode("utf-8"))
        if not _agrees(rust, table, skip):
            return None
        tables[skip] = table
    return tables


def _agrees(rust: Any, table: list[bytes], skip: bool) -> bool:
    """``lossy(join(table[ids]))`` equals ``rust.decode(ids)``: every id alone, and seeded
    random sequences (half of them bytes of multi-byte characters, split)."""
    singles = [[i] for i in range(len(table))]
    rng = random.Random(0)
    raw = [i for i, piece in enumerate(table) if len(piece) == 1 and piece[0] >= 0x80]
    seqs = [[rng.choice(raw) if raw and rng.random() < 0.5 else rng.randrange(len(table))
             for _ in range(rng.randrange(1, 24))] for _ in range(256)]
    cases = singles + seqs
    texts = rust.decode_batch(cases, skip_special_tokens=skip)
    return all(b"".join(table[i] for i in ids).decode("utf-8", "replace") == text
               for ids, text in zip(cases, texts, strict=True))


def ends_in_replacement(buf: bytes | bytearray) -> bool:
    """Whether ``buf.decode("utf-8", "replace")`` ends with U+FFFD (a character not yet
    whole, bytes that never make one, or U+FFFD itself), from its last four bytes."""
    n = len(buf)
    for k in range(n - 1, max(n - 5, -1), -1):
        if not 0x80 <= buf[k] <= 0xBF:  # decoding restarts here, whatever came before
            return buf[k:].decode("utf-8", "replace")[-1] == "\ufffd"
    return True  # four continuation bytes at the end: the last belongs to no character


def emits(buf: bytes | bytearray) -> bool:
    """``DecodeStream``'s emission rule for the bytes since its last emission."""
    return bool(buf) and not ends_in_replacement(buf)


class ByteDetokenizer(IncrementalDetokenizer):
    """``StreamingDetokenizer``'s text and deltas, with ``DecodeStream`` replaced by the
    bytes since the last emission (``_pending``) and the tokenizer's ``byte_pieces``.

    It follows ``StreamingDetokenizer``'s states exactly: the bytes while a
    ``DecodeStream`` would run (from the start, or primed with a prompt tail that decodes
    to whole text), the two window decodes otherwise (a prompt tail ending inside a
    character) until they emit a chunk that would prime a ``DecodeStream`` again. Without
    stop strings ``text`` stays what the windows left (nothing reads it then: every delta
    is sent at once), so a token costs no copy of the text so far."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], **kw: Any) -> None:
        self._table: list[bytes] = tokenizer.byte_pieces[kw.get("skip_special_tokens", True)]
        self._pending = bytearray()
        tail = list(prompt_token_ids[-_WINDOW:])
        self._bytes = not tail or emits(self._join(tail))  # DecodeStream primes with it
        super().__init__(tokenizer, tail, **kw)

    def _join(self, ids: list[int]) -> bytes:
        table, size = self._table, len(self._table)
        return b"".join([table[i] if 0 <= i < size else b"" for i in ids])

    def _next_bytes(self, token_id: int) -> str:
        pending = self._pending
        pending += self._table[token_id] if 0 <= token_id < len(self._table) else b""
        if not pending or (pending[-1] >= 0x80 and ends_in_replacement(pending)):
            return ""
        text = pending.decode("utf-8", "replace")
        pending.clear()
        return text

    def _decode_next(self, token_id: int) -> str:
        if not self._bytes:
            new_text = super()._decode_next(token_id)
            if new_text:  # a chunk: DecodeStream would be primed with it (``_resume``)
                self._bytes = emits(self._join(self._ids[self._prefix_offset:]))
            return new_text
        new_text = self._next_bytes(token_id)
        self.text += new_text
        return new_text

    def step(self, token_id: int) -> DetokenizerResult:
        if self._stop or not self._bytes:
            return super().step(token_id)
        new_text = self._next_bytes(token_id)
        return DetokenizerResult(new_text, False) if new_text else _NOTHING
