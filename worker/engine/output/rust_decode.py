"""``decode`` through the tokenizers library's own (Rust) ``Tokenizer``, without transformers.

The output process must not load transformers (which loads torch), and a fast tokenizer's
``decode`` is the Rust backend's plus an optional clean-up. ``decode_spec`` captures both
from the engine's tokenizer (the backend as its JSON, so hub ids, local paths and added
tokens all travel the same way); ``RustDecoder`` answers ``decode(ids,
skip_special_tokens=...)`` with the same text. A tokenizer without a Rust backend has no
spec: the output side then loads the tokenizer itself the old way.
"""

from __future__ import annotations

import json
from typing import Any


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


def text_decoder(tokenizer: Any) -> Any:
    """What an in-process output side detokenizes with: a ``RustDecoder`` where the
    tokenizer has a spec and its decoder streams (then ``make_detokenizer`` takes the byte
    table or ``DecodeStream``: one table look-up or one Rust call a token, where
    transformers' ``decode`` of a growing window cost two Python decodes a token, ~40-90 us
    at the default model), else ``tokenizer`` itself. The same text either way: the
    output process decodes this way (``tests/worker/engine/output/test_byte_detokenizer.py`` and
    ``test_decode_stream.py`` hold both to transformers' text)."""
    spec = decode_spec(tokenizer)
    if spec is None:
        return tokenizer
    decoder = RustDecoder(spec)
    return decoder if decoder.streams else tokenizer


# Decoders whose text for ids[:n] is always a prefix of the text for ids (per-token maps,
# byte joins, a strip at the very start): there ``DecodeStream`` never meets a chunk that
# stops extending the last one, so it follows the window decodes exactly.
_STREAM_SAFE = frozenset({"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Replace",
                          "Strip", "Sequence"})


class RustDecoder:
    def __init__(self, spec: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        from worker.engine.output.byte_table import byte_pieces

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
