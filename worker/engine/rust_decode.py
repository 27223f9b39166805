"""``decode`` through the tokenizers library's own (Rust) ``Tokenizer``, without transformers.

The output process must not load transformers (which loads torch), and a fast tokenizer's
``decode`` is the Rust backend's plus an optional clean-up. ``decode_spec`` captures both
from the engine's tokenizer (the backend as its JSON, so hub ids, local paths and added
tokens all travel the same way); ``RustDecoder`` answers ``decode(ids,
skip_special_tokens=...)`` with the same text. A tokenizer without a Rust backend has no
spec: the output side then loads the tokenizer itself the old way.
"""

from __future__ import annotations

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


class RustDecoder:
    def __init__(self, spec: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(spec["json"])
        self._clean_up = bool(spec["clean_up"])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text
