"""The sampler's rows: a request's sampling constants, as one object per request
(``SamplingRow``) and as columns by the scheduler's batch rows (``SamplerColumns``).

``SamplingRow`` is kept with its request across steps (``Request.sampling_row``) and
brought up to date at each (its output index, and for penalties its known outputs and the
token in flight), so a step of 256 rows does no per-row parameter work beyond a few
attribute reads (``sampler.py`` consumes the rows).

The columns: a step of 256 sampling rows would ask each ``SamplingRow`` the same questions
every step (is it penalised, masked, seeded; its parameters' bytes; its seed's mix and
output index for the noise key): a few hundred attribute reads and three generator passes
a step, on objects that the step's other work has pushed out of the cache. So those
answers are written once, when the request is admitted to a row of the scheduler's
``BatchRows`` (``SamplerColumns.admit``, a ``RowColumns`` the engine gives the scheduler),
and a step gathers its sampling rows' values with one array index per column
(``SamplerColumns.take``): the ``RowConstants`` the sampler reads in place of the row
objects' attributes. The values are the ones ``SamplingRow`` computes (``params_row_of``,
``seed_mix_of``), so the tokens drawn are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kernels.sampling_reference import mix64
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


# RowConstants.flags bits: the SamplingRow attribute each stands for
PENALISED = 1  # penalised
MASKED = 2  # masked: allowed_token_ids or bad words
LOGPROBS = 4  # wants_logprobs
NOT_PLAIN_GREEDY = 8  # not plain_greedy (sampled, or a logit bias)
SAMPLED = 16  # not greedy: the row draws with a noise key
SEEDED = 32  # seed_mix is not None
BIAS = 64  # has_bias
# not the sampler's: its tokens go into a step's batch one at a time (a grammar, prompt
# logprobs: ``Engine.apply_tokens``)
ONE_BY_ONE = 128


@dataclass(frozen=True, eq=False)
class RowConstants:
    """One step's sampling rows, in order: what ``Sampler.launch`` reads of each."""

    params: np.ndarray  # [B, 4] float32: SamplingRow.params_row
    seed_mix: np.ndarray  # [B] uint64: SamplingRow.seed_mix (0 where None)
    output_index: np.ndarray  # [B] int64: SamplingRow.output_index
    flags: np.ndarray  # [B] uint8: the bits above
    union: int  # the bits any row has

    def any(self, flag: int) -> bool:
        return bool(self.union & flag)

    def rows_with(self, flag: int) -> list[int]:
        return (self.flags & flag).nonzero()[0].tolist()  # type: ignore[no-any-return]


class RowFacts:
    """``RowConstants``'s questions answered from the row objects (when no constants are given:
    outputs built by hand, speculative steps)."""

    _ATTRS = {PENALISED: "penalised", MASKED: "masked", LOGPROBS: "wants_logprobs"}

    def __init__(self, rows: list[SamplingRow]) -> None:
        self.rows = rows

    def any(self, flag: int) -> bool:
        if flag == NOT_PLAIN_GREEDY:
            return not all(r.plain_greedy for r in self.rows)
        return any(map(attrgetter(self._ATTRS[flag]), self.rows))

    def rows_with(self, flag: int) -> list[int]:
        get = attrgetter(self._ATTRS[flag])
        return [i for i, r in enumerate(self.rows) if get(r)]


def flags_of(request: Request) -> int:
    """The ``RowConstants.flags`` of a request's rows (as ``SamplingRow`` answers them)."""
    p = request.params
    masked = p.allowed_token_ids is not None or bool(request.bad_words_ids)
    return (PENALISED * bool(request.penalised) | MASKED * masked
            | LOGPROBS * (p.logprobs is not None)
            | NOT_PLAIN_GREEDY * (not request.plain_greedy) | SAMPLED * (not p.greedy)
            | SEEDED * (not p.greedy and p.seed is not None) | BIAS * bool(p.logit_bias)
            | ONE_BY_ONE * (request.grammar is not None or request.prompt_logprobs is not None))


class SamplerColumns:
    """The columns, by ``BatchRows`` row; a row's values are its request's from admission."""

    def __init__(self, rows: int = 0) -> None:
        self.params = np.zeros((rows, 4), dtype=np.float32)
        self.seed_mix = np.zeros(rows, dtype=np.uint64)
        self.flags = np.zeros(rows, dtype=np.uint8)
        self.prompt_len = np.zeros(rows, dtype=np.int64)  # output index: tokens - this

    def admit(self, row: int, request: Request) -> None:
        cache = request.sampler_cache
        self.params[row] = params_row_of(request.params, cache)
        self.seed_mix[row] = seed_mix_of(request.params, cache) or 0
        self.flags[row] = flags_of(request)
        self.prompt_len[row] = request.num_prompt_tokens

    def grow(self, size: int) -> None:
        for name in ("params", "seed_mix", "flags", "prompt_len"):
            old = getattr(self, name)
            new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def check(self, row: int, request: Request) -> None:
        """AssertionError unless the row's flags are the request's (the tests' check)."""
        assert self.flags[row] == flags_of(request), f"{request.request_id}: sampler flags"

    def take(self, rows: np.ndarray, tokens: np.ndarray) -> RowConstants:
        """The constants of ``rows`` (in order), whose requests hold ``tokens`` tokens each
        (``BatchRows.tokens``: their output index is what follows the prompt)."""
        flags = self.flags[rows]
        return RowConstants(self.params[rows], self.seed_mix[rows],
                             tokens - self.prompt_len[rows], flags,
                             int(np.bitwise_or.reduce(flags)) if len(flags) else 0)
