"""Parallel tool calls within ``max_tokens``: the list ends where the tokens left cannot hold
another call, instead of starting one that would be cut (docs/tools.md measures it).

A model that never learned to stop after a call (the default model) starts call after
call until ``max_tokens`` cuts the last one in half: ``ops/bench/techniques/cut_calls.py`` found 97
of 140 parallel-call answers ending in a cut call. Where a list of calls is complete the
grammar accepts, and the model may write another call or end; ``CallBudget`` ends it (the
mask keeps only EOS) when fewer tokens are left than the shortest call of this output
took. It depends on the output's own tokens and ``max_tokens`` only, so a request gives
the same tokens with speculation on or off, and it never ends a list the grammar would
not let end. Only for ``required`` / ``named`` calls with parallel calls on, where the
output is calls and nothing else.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

from protocol.sampling import SamplingParams


@dataclass
class CallBudget:
    """One request's call ends so far, as the output grows token by token."""

    max_tokens: int
    min_tokens: int
    eos: tuple[int, ...]
    last_end: int = 0  # output length where the last complete call ended
    shortest: int | None = None  # tokens the shortest call took (its separator included)
    accepting: bool = False  # the grammar accepts the output so far (a call just ended)

    @staticmethod
    def of(params: SamplingParams, eos: frozenset[int]) -> CallBudget | None:
        """The budget of a request whose output is a list of parallel calls, else None."""
        spec = params.structured_output
        tools = spec.tools if spec is not None else None
        if tools is None or tools.mode == "auto" or not tools.parallel \
                or tools.max_calls < 2 or params.ignore_eos or not eos:
            return None
        return CallBudget(params.max_tokens, params.min_tokens, tuple(sorted(eos)))

    def fresh(self) -> CallBudget:
        return CallBudget(self.max_tokens, self.min_tokens, self.eos)

    def copy(self) -> CallBudget:
        return dataclasses.replace(self)

    def step(self, length: int, accepting: bool) -> None:
        """After the token that made the output ``length`` tokens long."""
        if accepting and not self.accepting:
            took = length - self.last_end
            self.shortest = took if self.shortest is None else min(self.shortest, took)
            self.last_end = length
        self.accepting = accepting

    def must_end(self, length: int) -> bool:
        """At an output of ``length`` tokens: a call just ended and another would not fit."""
        return self.accepting and self.shortest is not None \
            and length >= self.min_tokens and self.max_tokens - length < self.shortest

    def end_only(self, ptr: int, row_bytes: int) -> None:
        """Make the mask row at ``ptr`` allow EOS alone."""
        ctypes.memset(ptr, 0, row_bytes)
        for token in self.eos:
            if token // 32 < row_bytes // 4:
                word = ctypes.c_uint32.from_address(ptr + 4 * (token // 32))
                word.value |= 1 << (token % 32)
