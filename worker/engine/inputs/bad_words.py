"""Bad words -> the token sequences a request may not generate, derived as vLLM does.

vLLM (``SamplingParams.update_from_tokenizer``) tokenizes each word twice, as written (its
leading spaces stripped) and after one space, and keeps the second only when it is a
different token sequence of the same length: a word is banned at the start of the text
and in the middle of it. The sampler bans a sequence's last token wherever the tokens
before it end the output so far (``logits_processors.apply_bad_words``), so a one-token
word is never generated and a longer one never completed.

The prompt pool's threads derive and check the sequences (``PromptBuilder.build``); the
engine loop asks again when it queues the request and finds them in a small cache, so
its thread does not tokenize.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

Sequences = tuple[tuple[int, ...], ...]


def word_token_ids(tokenizer: Any, words: Sequence[str]) -> Sequences:
    """vLLM's derivation, word by word (without and with a leading space)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(seq for seq in out if seq)


class BadWords:
    """``token_ids(tokenizer, words)``, checked against the model's vocabulary and cached
    by word list (thread-safe)."""

    def __init__(self, vocab_size: int, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, ...], Sequences] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()

    def token_ids(self, tokenizer: Any, words: Sequence[str] | None) -> Sequences:
        """Raises ``ValueError`` (``"bad_words: ..."``) for a token outside the vocabulary."""
        if not words:
            return ()
        key = tuple(words)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        sequences = word_token_ids(tokenizer, key)
        bad = next((t for seq in sequences for t in seq if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"bad_words: token id {bad} outside [0, {self.vocab_size})")
        with self._lock:
            self._cache[key] = sequences
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return sequences
