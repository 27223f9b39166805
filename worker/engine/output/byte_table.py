"""The token -> bytes table of a ``ByteLevel``-decoded tokenizer (``ByteDetokenizer``'s).

For such a tokenizer ``decode(ids)`` is ``String::from_utf8_lossy`` of the joined token
bytes, so one table answers it. ``byte_pieces`` builds the table from the vocabulary and
the added tokens, per ``skip_special_tokens``, and accepts it only when it agrees with the
tokenizer's own ``decode`` (every id alone, and seeded random sequences); the output
process's ``RustDecoder`` builds it once at start-up.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from worker.engine.output.detokenizer import DetokenizerResult


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


class ByteTable(NamedTuple):
    """One ``skip_special_tokens`` setting's table: each id's bytes, and its text where those
    bytes are whole characters on their own (None: not, or empty), so a token that starts
    a chunk and ends it costs a look-up (``results``: its ``DetokenizerResult``, shared)."""

    pieces: list[bytes]
    whole: list[str | None]
    results: dict[int, DetokenizerResult]


def byte_pieces(rust: Any, data: dict[str, Any]) -> dict[bool, ByteTable] | None:
    """The ``ByteTable`` per ``skip_special_tokens`` of a ``ByteLevel``-decoded tokenizer
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
    tables: dict[bool, ByteTable] = {}
    for skip in (False, True):
        table = [b"" if skip and token in special else piece
                 for token, piece in zip(tokens, full, strict=True)]
        if not _agrees(rust, table, skip, alone[skip]):
            return None
        tables[skip] = ByteTable(table, [_whole(piece) for piece in table], {})
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
