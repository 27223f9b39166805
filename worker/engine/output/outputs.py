"""Text outputs: per-step deltas and finished completions (made by ``text_output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextOutput:
    """New tokens of one request in one step (the unit the service publishes)."""

    request_id: str
    new_token_ids: list[int]
    text: str  # UTF-8-safe text delta
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # with "stop": the stop string or stop token id
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Per new token: (logprob of the token, [(token id, logprob), ...top-n]).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    index: int = 0  # which candidate of the request (n > 1 / best_of); ``finished`` is its own
    cumulative_logprob: float | None = None  # on a finished candidate that was ranked
    # On an error: "invalid_request" when the request itself is at fault (e.g. a grammar
    # that does not compile), else None (the worker's fault).
    error_kind: str | None = None
    # On a request's first output, if it asked: every prompt token's (id, logprob or None
    # for the first, top-k), worker/engine/sample/prompt_logprobs.py.
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None
    # On a finished output: its prompt tokens served from the prefix cache at its first
    # scheduling (either KV tier), vLLM's num_cached_tokens
    num_cached_tokens: int = 0


@dataclass
class ChoiceOutput:
    """One of a request's choices (``n > 1`` / ``best_of``)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None


@dataclass
class CompletionOutput:
    """A finished request, as ``LLM.generate`` returns it: the first (best) choice's fields,
    and every choice in ``choices`` (one unless ``n > 1``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    choices: list[ChoiceOutput] = field(default_factory=list)
    stop_reason: str | int | None = None
