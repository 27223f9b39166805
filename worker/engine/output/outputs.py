"""Text outputs: per-step deltas and finished completions (made by ``text_output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepOutput:
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


@dataclass
class EngineStats:
    """A snapshot for heartbeats, metrics and ``ferry top``."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    tokens_generated: int
    steps: int
    prefix_cache_queries: int = 0  # tokens looked up when requests were admitted
    prefix_cache_hits: int = 0  # of which found in the prefix cache (not computed)
    kv_blocks_cached: int = 0  # blocks holding a reusable prefix (held or evictable)
    # The KV host tier (kv_host_tier.py): hits taken from it (tokens, also counted in
    # prefix_cache_hits), blocks it holds, its size in blocks (0: off).
    prefix_cache_host_hits: int = 0
    kv_host_blocks_cached: int = 0
    kv_host_blocks_total: int = 0
    # Degraded states (worker/engine/health.py: DEGRADED_REASONS), empty when healthy, and
    # whether pure-decode steps replay CUDA graphs.
    degraded: tuple[str, ...] = ()
    decode_graphs_active: bool = False
    # Speculative decoding (#29): draft tokens verified, of which accepted, and the
    # row-steps that carried drafts (each yields accepted + 1 tokens), and the draft tokens
    # cut before verification because a request's grammar rejected them
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_rows: int = 0
    spec_store_rows: int = 0  # ... whose draft came from past outputs (fleet's too)
    spec_grammar_cut_tokens: int = 0
    spec_backoff_cut_tokens: int = 0  # ... and because the back-off found them not worth it

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a drafted row gets per step on average (1 to k + 1; 0: no drafts)."""
        return (self.spec_accepted_tokens + self.spec_draft_rows) / self.spec_draft_rows \
            if self.spec_draft_rows else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0
