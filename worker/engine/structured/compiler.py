"""The grammar compile cache: each distinct constraint compiled once, off the engine loop.

Split from ``structured.py`` (which owns the per-request matchers and the step's masks):
this owns the llguidance tokenizer, the compile pool and the LRU of pristine matchers.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import OrderedDict
from typing import Any

from protocol.structured.constraint import StructuredOutput, grammar_for
from protocol.structured.tool_syntax import detect_syntax

CACHE_SIZE = 256  # distinct constraints kept compiled (LRU); a pristine matcher is small


class GrammarCompiler:
    """Compiles each distinct constraint once, off the engine loop, and caches the result.

    The cache is keyed by the constraint's canonical text; the tokenizer is fixed per
    engine, so it is part of the key by construction. Failures are cached too: a bad
    schema sent a thousand times is compiled once.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 threads: int = 1, cache_size: int = CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()  # the cache (the engine loop takes it: never held long)
        self._tokenizer_lock = threading.Lock()  # building the tokenizer (pool threads only)
        self._cache: OrderedDict[str, cf.Future[Any]] = OrderedDict()
        self._cache_size = cache_size
        # how this model writes tool calls: its chat template's family (docs/tools.md)
        self.syntax = detect_syntax(getattr(tokenizer, "chat_template", None))
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="ferry-grammar")
        self.compiles = 0  # cache misses, for tests and metrics

    def compile(self, spec: StructuredOutput) -> cf.Future[Any]:
        """A future pristine matcher for ``spec`` (done at once on a cache hit)."""
        key = spec.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            self.compiles += 1
            future = self._pool.submit(self._build, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _build(self, spec: StructuredOutput) -> Any:
        """Runs on the pool: grammar text -> matcher; ValueError naming the field if invalid."""
        import llguidance

        grammar = grammar_for(spec, self.syntax)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            message = " ".join(matcher.get_error().split())[:500]
            raise ValueError(f"{spec.kind}: {message}")
        return matcher

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos)
                except ValueError as exc:  # not a fast tokenizer
                    raise ValueError(f"structured_output: unsupported tokenizer ({exc})") from None
            return self._ll_tokenizer

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
