"""One row of the logits as the sampler reads it: a request's sampling parameters and the
answers to what every step asks of them, computed once per request.

Why a module of its own: the row is kept with its request across steps
(``Request.sampling_row``) and brought up to date at each (its output index, and for
penalties its known outputs and the token in flight), so a step of 256 rows does no
per-row parameter work beyond a few attribute reads (``sampler.py`` consumes the rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kernels.sampling_noise import mix64
from protocol.sampling import SamplingParams
from worker.engine.sample.logits_processors import wants_penalties

if TYPE_CHECKING:
    from worker.engine.request import Request


class _Sampled(Protocol):
    tokens: torch.Tensor  # [rows] int64: the step's sampled tokens (on the device)


class StepInFlight(Protocol):
    """What a row reads of the step in flight (``inflight.InflightStep``; named here by
    shape, as ``inflight`` imports the sampler and so this module)."""

    @property
    def sample(self) -> _Sampled: ...

    @property
    def row_of(self) -> dict[str, int]: ...


_NO_TOP_K = 1 << 24  # top-k off: at least any vocabulary (exact in float32)
_SEED_MIX = "seed_mix"  # SamplingRow.cache: mix64 of the request's seed (its keys' base)
_PARAMS = "sampling_params"  # SamplingRow.cache: the row of ``SamplingTensors.host``


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    output_index: int  # index of the token being sampled within the request's output
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # known output tokens; only penalties read them
    # Per request, kept across its steps: device tensors built once (the prompt's mask)
    cache: dict[str, Any] = field(default_factory=dict)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # banned token sequences
    # [1] int64 on the device: the output token of the step still in flight (a
    # placeholder on the host), which penalties count there without a host sync.
    pending_output: torch.Tensor | None = None
    # from the params (``Request`` answers them once): any penalty; greedy with no bias
    penalised: bool | None = None
    plain_greedy: bool | None = None
    # answered once from the params (plain attributes: a pydantic property read costs
    # ~0.3 us, and a step asks each of 256 rows several questions)
    greedy: bool = field(init=False)
    masked: bool = field(init=False)  # allowed_token_ids or bad words
    wants_logprobs: bool = field(init=False)
    seed_mix: int | None = field(init=False)  # mix64(seed) of a seeded sampled row
    params_row: tuple[float, float, float, float] = field(init=False)  # SamplingTensors.host
    params_bytes: bytes = field(init=False)  # params_row as 4 float32s
    has_bias: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        if self.penalised is None:
            self.penalised = wants_penalties(params)
        if self.plain_greedy is None:
            self.plain_greedy = params.greedy and not params.logit_bias
        self.greedy = params.greedy
        self.masked = params.allowed_token_ids is not None or bool(self.bad_words_ids)
        self.wants_logprobs = params.logprobs is not None
        self.seed_mix = seed_mix_of(params, self.cache)
        self.params_row = params_row_of(params, self.cache)
        self.params_bytes = np.array(self.params_row, dtype=np.float32).tobytes()
        self.has_bias = bool(params.logit_bias)

    @classmethod
    def of(cls, request: Request, in_flight: StepInFlight | None = None) -> SamplingRow:
        """The row of a request about to sample: its output index counts the tokens of
        steps still in flight; its output tokens are copied only for penalties and
        multi-token bad words. ``in_flight``: the step in flight, whose sampled tokens (on
        the device) hold the request's pending one (``inflight.py``).

        One row object per request, made at its first step and brought up to date at each
        later one (building 256 rows a step cost ~0.3 ms): a step's rows are read while it
        is launched and, for their params alone, when its logprobs are unpacked."""
        row: SamplingRow | None = request.sampling_row
        if row is None:
            row = request.sampling_row = cls(
                request.params, 0, request.prompt_token_ids, (), request.sampler_cache,
                request.bad_words_ids, None, request.penalised, request.plain_greedy)
        row.output_index = len(request.output_token_ids)
        if row.penalised or request.bans_follow_output:
            row.output_token_ids = request.known_output_ids
            row.pending_output = None
            if row.penalised and request.num_pending:
                i = -1 if in_flight is None else in_flight.row_of.get(request.request_id, -1)
                if in_flight is None or i < 0 or request.num_pending > 1:
                    raise RuntimeError(f"{request.request_id}: a pending token with no "
                                       "step in flight to read it from")
                row.pending_output = in_flight.sample.tokens[i:i + 1]  # a view
        return row

    @classmethod
    def rows_of(cls, requests: list[Request],
                in_flight: StepInFlight | None = None) -> list[SamplingRow]:
        """``of`` for each request, in order: a row made before that reads no outputs
        (most of a batch) only moves its output index, inlined here (no call per row)."""
        rows = []
        for request in requests:
            row = request.sampling_row
            if row is None or row.penalised or request.bans_follow_output:
                row = cls.of(request, in_flight)
            else:
                row.output_index = len(request.output_token_ids)
            rows.append(row)
        return rows

    def refresh(self, request: Request) -> None:
        """The step before was read back since the row was made: its token is known."""
        if self.penalised or request.bans_follow_output:
            self.output_token_ids = request.known_output_ids
            self.pending_output = None


def seed_mix_of(params: SamplingParams, cache: dict[str, Any]) -> int | None:
    """``mix64`` of a seeded sampled request's seed (None: greedy, or no seed), kept in
    its request's cache (``Request.sampler_cache``)."""
    if params.greedy or params.seed is None:
        return None
    seed_mix = cache.get(_SEED_MIX)
    if seed_mix is None:
        seed_mix = cache[_SEED_MIX] = mix64(params.seed)
    return seed_mix  # type: ignore[no-any-return]


def params_row_of(params: SamplingParams,
                  cache: dict[str, Any]) -> tuple[float, float, float, float]:
    """A request's (temperature, top-p, min-p, top-k) as the sampling pass reads them, kept
    in its request's cache (the params never change)."""
    value = cache.get(_PARAMS)
    if value is None:
        p = params
        cache[_PARAMS] = value = (0.0 if p.greedy else p.temperature, p.top_p, p.min_p,
                                  float(p.top_k if p.top_k > 0 else _NO_TOP_K))
    return value  # type: ignore[no-any-return]
