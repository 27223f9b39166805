"""``decode`` through the tokenizers library's own (Rust) ``Tokenizer``, without transformers.

The output process must not load transformers (which loads torch), and a fast tokenizer's
``decode`` is the Rust backend's plus an optional clean-up. ``decode_spec`` captures both
from the engine's tokenizer (the backend as its JSON, so hub ids, local paths and added
tokens all travel the same way); ``RustDecoder`` answers ``decode(ids,
skip_special_tokens=...)`` with the same text. A tokenizer without a Rust backend has no
spec: the output side then loads the tokenizer itself (transformers).

For a ``ByteLevel`` decoder (GPT-2, Llama 3, Qwen, the default model) ``decode(ids)`` is
``String::from_utf8_lossy`` of the joined token bytes, so one id -> bytes table answers it:
``byte_pieces`` builds it from the vocabulary and the added tokens, per
``skip_special_tokens``, and accepts it only when it agrees with the tokenizer's own
``decode`` (every id alone, and seeded random sequences); ``RustDecoder`` builds it once
(``byte_detokenizer.ByteDetokenizer`` reads it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any, NamedTuple

from worker.engine.output.detokenizer import DetokenizerResult


def decode_spec(tokenizer: Any) -> dict[str, Any] | None:
    """What an output process needs to decode like ``tokenizer`` (None: not a fast one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    force = getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
        False)
    if clean_up and type(backend.model).__name__ == "BPE" and not force:
        clean_up = False  # transformers skips the WordPiece clean-up for BPE models
    return {"json": backend.to_str(), "clean_up": clean_up}


def text_decoder(spec: dict[str, Any] | None, load: Callable[[], Any]) -> Any:
    """What the output side detokenizes with, in the engine's process and in an output
    process alike: a ``RustDecoder`` where the engine's tokenizer has a Rust spec
    (``decode_spec``; ``make_detokenizer`` then takes its byte table, its ``DecodeStream``,
    or window decodes through its ``decode`` where it cannot stream), else ``load()``, the
    tokenizer itself. The byte table or ``DecodeStream`` is one table look-up or one Rust
    call a token, where transformers' ``decode`` of a growing window cost two Python
    decodes a token (~40-90 us at the default model). The text is transformers' either way
    (``tests/worker/engine/output/test_text_decoder.py`` over the repository's tokenizers,
    ``test_byte_detokenizer.py`` and ``test_decode_stream.py``)."""
    return RustDecoder(spec) if spec is not None else load()


# Decoders whose text for ids[:n] is always a prefix of the text for ids (per-token maps,
# byte joins, a strip at the very start): there ``DecodeStream`` never meets a chunk that
# stops extending the last one, so it follows the window decodes exactly.
_STREAM_SAFE = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Replace",
                          "Strip", "Sequence"})


class RustDecoder:
    def __init__(self, spec: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.rust = Tokenizer.from_str(spec["json"])
        self._clean_up = bool(spec["clean_up"])
        data = json.loads(spec["json"])
        # ``DecodeStream`` (one Rust decode a token, not two): never with transformers'
        # clean-up (it rewrites text across chunks), only with a prefix-safe decoder.
        self.streams = not self._clean_up and _stream_safe(data.get("decoder"))
        # Better still, a ByteLevel decoder's text is the token bytes' (``ByteDetokenizer``:
        # no decode of a growing buffer); None: not ByteLevel, or the table disagreed.
        self.byte_pieces = byte_pieces(self.rust, data) if self.streams else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def decode_stream(self, skip_special_tokens: bool) -> Any:
        """A fresh ``tokenizers.decoders.DecodeStream`` (``detokenizer.StreamingDetokenizer``)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)


def _stream_safe(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False  # no decoder: tokens joined with spaces, WordPiece-like; keep windows
    if decoder.get("type") not in _STREAM_SAFE:
        return False
    return all(_stream_safe(d) for d in decoder.get("decoders", []))


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


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


class TokenBytes(NamedTuple):
    """One ``skip_special_tokens`` setting's table: each id's bytes, and its text where those
    bytes are whole characters on their own (None: not, or empty), so a token that starts
    a chunk and ends it costs a look-up (``results``: its ``DetokenizerResult``, shared)."""

    pieces: list[bytes]
    whole: list[str | None]
    results: dict[int, DetokenizerResult]


def byte_pieces(rust: Any, data: dict[str, Any]) -> dict[bool, TokenBytes] | None:
    """The ``TokenBytes`` per ``skip_special_tokens`` of a ``ByteLevel``-decoded tokenizer
    (``rust``: a ``tokenizers.Tokenizer``; ``data``: its JSON); None when the decoder is
    anything else or the table disagrees with ``rust.decode`` (then ``DecodeStream``)."""
    decoder = data.get("decoder")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return None
    chars = gpt2_byte_chars()
    special = {t["content"] for t in data.get("added_tokens") or [] if t.get("special")}
    size = max([rust.get_vocab_size(with_added_tokens=True)]
               + [t["id"] + 1 for t in data.get("added_tokens") or []])
    tokens: list[str | None] = [None] * size
    for token, i in rust.get_vocab(with_added_tokens=False).items():
        tokens[i] = token
    for added in data.get("added_tokens") or []:  # decode looks these up first
        tokens[added["id"]] = added["content"]
    full = [b"" if token is None else bytes(chars[c] for c in token)
            if all(c in chars for c in token) else token.encode("utf-8") for token in tokens]
    # skipping changes only the special tokens' text: every id alone once, those twice
    alone = {False: list(range(size)), True: [i for i, t in enumerate(tokens) if t in special]}
    tables: dict[bool, TokenBytes] = {}
    for skip in (False, True):
        table = [b"" if skip and token in special else piece
                 for token, piece in zip(tokens, full, strict=True)]
        if not _agrees(rust, table, skip, alone[skip]):
            return None
        tables[skip] = TokenBytes(table, [_whole(piece) for piece in table], {})
    return tables


def _whole(piece: bytes) -> str | None:
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text and text[-1] != "\ufffd" else None


def _agrees(rust: Any, table: list[bytes], skip: bool, alone: list[int]) -> bool:
    """``lossy(join(table[ids]))`` equals ``rust.decode(ids)``: each id of ``alone`` by
    itself, and seeded random sequences (half of them bytes of multi-byte characters)."""
    singles = [[i] for i in alone]
    rng = random.Random(0)
    raw = [i for i, piece in enumerate(table) if len(piece) == 1 and piece[0] >= 0x80]
    seqs = [[rng.choice(raw) if raw and rng.random() < 0.5 else rng.randrange(len(table))
             for _ in range(rng.randrange(1, 24))] for _ in range(256)]
    cases = singles + seqs
    texts = rust.decode_batch(cases, skip_special_tokens=skip)
    return all(b"".join(table[i] for i in ids).decode("utf-8", "replace") == text
               for ids, text in zip(cases, texts, strict=True))
