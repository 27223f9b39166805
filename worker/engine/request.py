"""Request state as counters, in the style of vLLM v1.

Progress is ``num_computed_tokens`` catching up with ``num_tokens``: a prompt being
prefilled in chunks, a decode step and a recompute after preemption are all the same
thing — schedule ``num_tokens - num_computed_tokens`` more tokens — so the scheduler
needs no phase machine.

With overlapped steps (``worker/engine/inflight.py``) a token is counted when its step is
launched, before its value is known: the token lists end with ``num_pending``
placeholders, filled in order as their steps are read back. Everything that needs token
*values* (stops, hashes, grammars, penalties) reads only the known ones.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from protocol.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


PLACEHOLDER = -1  # a token sampled by a step still running on the device


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed; the event carries the message

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Request:
    """One generation: its tokens, its progress and why it ended."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # With STOP: the stop string or stop token id that ended it (vLLM's stop_reason);
    # None for EOS or a finished grammar.
    stop_reason: str | int | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Output tokens that existed when the request was (re)submitted, e.g. tokens already
    # streamed by a worker that died; they count toward max_tokens but are not re-sent.
    num_prior_output_tokens: int = 0
    # n > 1 / best_of (worker/engine/choices.py): the request this candidate belongs to and
    # its index among the candidates; its cumulative logprob when candidates are ranked.
    parent_id: str | None = None
    index: int = 0
    report_logprobs: bool = True
    cumulative_logprob: float = 0.0
    # Chained hashes of the request's full blocks (worker/engine/kv/block_manager.py), grown
    # lazily; full blocks never change, so they stay valid across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    # [structured output] the request's grammar matcher (worker/engine/structured/decoding.py:
    # RequestGrammar); the scheduler leaves the request waiting until it is ready.
    grammar: Any = None
    # Tokens at the end of the lists sampled by steps not read back yet (PLACEHOLDER).
    num_pending: int = 0
    # What the sampler keeps for this request across steps (sampling_row.SamplingRow.cache):
    # device tensors built once, e.g. its prompt's token mask for the repetition penalty.
    sampler_cache: dict[str, Any] = field(default_factory=dict)
    # params.prompt_logprobs: one entry per prompt token scored so far
    # (worker/engine/sample/prompt_logprobs.py), handed out once with the first output.
    prompt_logprobs: list[Any] | None = None
    prompt_logprobs_sent: bool = False
    # params.bad_words as token sequences (worker/engine/inputs/bad_words.py)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # multi-LoRA: the adapter the request runs with (a LoraAdapter: its host
    # weights, kept even if the adapter is unloaded before the request ends)
    lora: Any = None
    # the request's sampling_row.SamplingRow, made at its first sampling step and kept
    sampling_row: Any = None
    # The prefix-cache partition it may match (worker/engine/kv/block_manager.py): requests
    # of different scopes never share a block; None, the shared default space.
    cache_scope: str | None = None
    # Prompt tokens served from the prefix cache (either KV tier) at its first scheduling
    # (vLLM's num_cached_tokens); -1 until then.
    num_cached_tokens: int = -1

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_prior_output_tokens = len(self.output_token_ids)
        self.stop_token_ids = frozenset(self.params.stop_token_ids)
        # a multi-token bad word is banned after its first tokens: sampling reads outputs
        self.bans_follow_output = any(len(seq) > 1 for seq in self.bad_words_ids)
        # what the sampler asks of the params every step, answered once (they never change)
        self.penalised = self.params.wants_penalties
        self.plain_greedy = self.params.greedy and not self.params.logit_bias

    @property
    def public_id(self) -> str:
        """The id outputs carry: the parent request's, for one of several candidates."""
        return self.parent_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known (all but the pending placeholders)."""
        return len(self.all_token_ids) - self.num_pending

    @property
    def known_output_ids(self) -> list[int]:
        out = self.output_token_ids
        return out[:len(out) - self.num_pending] if self.num_pending else out

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_placeholder(self) -> None:
        """A token sampled by a step just launched; ``resolve_placeholder`` fills it."""
        self.append_output_token(PLACEHOLDER)
        self.num_pending += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """The oldest pending token's value, read back from its step."""
        assert self.num_pending > 0, f"{self.request_id}: no pending token to resolve"
        self.output_token_ids[-self.num_pending] = token_id
        self.all_token_ids[-self.num_pending] = token_id
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget the tokens of steps still in flight (the request ends before them)."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            del self.all_token_ids[-self.num_pending:]
            self.num_pending = 0

    def will_finish_by_length(self, max_model_len: int) -> bool:
        """Its pending tokens already reach max_tokens or the model's context: another
        step would compute a token that can only be dropped (or lies past the context)."""
        return self.num_pending > 0 and (self.num_output_tokens >= self.params.max_tokens
                                         or self.num_tokens >= max_model_len)

    def check_token_stop(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Finish reason implied by ``token_id``, the newest known token (stop strings
        aside); counts are of known tokens: later placeholders do not count. A stop token
        id (not EOS) is kept as the ``stop_reason``."""
        known_outputs = self.num_output_tokens - self.num_pending
        eos = not self.params.ignore_eos and token_id in self.eos_token_ids
        if known_outputs >= self.params.min_tokens and \
                (eos or token_id in self.stop_token_ids):
            self.note_stop_token(token_id)
            return FinishReason.STOP
        if known_outputs >= self.params.max_tokens or \
                self.num_known_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def note_stop_token(self, token_id: int) -> None:
        """Keep ``token_id``, which stopped the request, as its ``stop_reason`` when it is
        one of the caller's stop ids rather than EOS (vLLM reports EOS as no reason)."""
        eos = not self.params.ignore_eos and token_id in self.eos_token_ids
        if not eos and token_id in self.stop_token_ids:
            self.stop_reason = token_id

    @property
    def needs_prompt_logits(self) -> bool:
        """Asks for prompt logprobs and misses some: its prompt positions must be computed
        (not taken from the prefix cache) and their logits kept."""
        return self.prompt_logprobs is not None \
            and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def waiting_for_grammar(self) -> bool:  # [structured output]
        return self.grammar is not None and not self.grammar.ready

    def sort_key(self) -> tuple[int, float]:
        """Waiting order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)

