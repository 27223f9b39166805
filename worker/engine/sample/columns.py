"""The sampler's per-request constants as columns, one row per running request.

A step of 256 sampling rows asked each ``SamplingRow`` the same questions every step (is
it penalised, masked, seeded; its parameters' bytes; its seed's mix and output index for
the noise key): a few hundred attribute reads and three generator passes a step, on
objects that the step's other work has pushed out of the cache. Here those answers are
written once, when the request is admitted to a row of the scheduler's ``BatchRows``
(``SamplerColumns.admit``), and a step gathers its sampling rows' values with one array
index per column (``SamplerColumns.take``): the ``SamplingTable`` the sampler reads in
place of the row objects' attributes. The values are the ones ``SamplingRow`` computes
(``params_row_of``, ``seed_mix_of``), so the tokens drawn are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from worker.engine.sample.sampling_row import SamplingRow, params_row_of, seed_mix_of

if TYPE_CHECKING:
    from worker.engine.request import Request

# SamplingTable.flags bits: the SamplingRow attribute each stands for
PENALISED = 1  # penalised
MASKED = 2  # masked: allowed_token_ids or bad words
LOGPROBS = 4  # wants_logprobs
NOT_PLAIN_GREEDY = 8  # not plain_greedy (sampled, or a logit bias)
SAMPLED = 16  # not greedy: the row draws with a noise key
SEEDED = 32  # seed_mix is not None
BIAS = 64  # has_bias
# not the sampler's: its tokens go into a step's batch one at a time (a grammar, prompt
# logprobs: ``Engine._update``)
ONE_BY_ONE = 128


@dataclass(frozen=True, eq=False)
class SamplingTable:
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
    """``SamplingTable``'s questions answered from the row objects (when no table is given:
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
    """The ``SamplingTable.flags`` of a request's rows (as ``SamplingRow`` answers them)."""
    p = request.params
    masked = p.allowed_token_ids is not None or bool(request.bad_words_ids)
    return (PENALISED * bool(request.penalised) | MASKED * masked
            | LOGPROBS * (p.logprobs is not None)
            | NOT_PLAIN_GREEDY * (not request.plain_greedy) | SAMPLED * (not p.greedy)
            | SEEDED * (not p.greedy and p.seed is not None) | BIAS * bool(p.logit_bias)
            | ONE_BY_ONE * (request.grammar is not None or request.prompt_logprobs is not None))


class SamplerColumns:
    """The columns, by ``BatchRows`` row; a row's values are its request's from admission."""

    def __init__(self, rows: int) -> None:
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

    def take(self, rows: np.ndarray, tokens: np.ndarray) -> SamplingTable:
        """The table of ``rows`` (in order), whose requests hold ``tokens`` tokens each
        (``BatchRows.tokens``: their output index is what follows the prompt)."""
        flags = self.flags[rows]
        return SamplingTable(self.params[rows], self.seed_mix[rows],
                             tokens - self.prompt_len[rows], flags,
                             int(np.bitwise_or.reduce(flags)) if len(flags) else 0)
