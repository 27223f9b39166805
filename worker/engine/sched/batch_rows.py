"""The running requests' counters as arrays, one row per request: the scheduler's batch view.

At 256 running requests a loop over request objects costs the step more host time than
the GPU's forward takes, so the per-step decisions are made over arrays (as vLLM v1's
``InputBatch`` does): which rows are plain decodes (``decodes``), the step's finish
checks (EOS, stop ids, ``min_tokens``, ``max_tokens``, the model's context: ``resolve``),
and the counters ``advance`` and ``resolve`` move. Rows are the block manager's
(``host_tables.py``): a request has one from admission until it is preempted or
finished. The arrays are written when it is admitted and kept equal to its ``Request``
fields by every scheduler method that changes them (``check`` proves it in the tests,
before every step).

``Request`` stays the truth for everything else (token lists, parameters); a row's limits
and stop ids are copied at admission, when the request's parameters are final, as token
counts: ``min_known`` (known tokens from which EOS / stop ids count) and ``max_known``
(known tokens at which it ends by length: ``max_tokens`` or the model's context).

Other parts may keep their own per-row values by these rows (``RowColumns``: the engine
gives the sampler's constants, ``sample/rows.py``); the batch only tells them when a
request takes a row and when the rows grow, so the scheduler knows nothing of sampling.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from worker.engine.kv.host_tables import HostTables
from worker.engine.request import PLACEHOLDER, Request

_NO_TOKEN = -2  # pads a row's stop ids: never a sampled token, nor the placeholder
_INT_FIELDS = ("computed", "tokens", "known", "last", "min_known", "max_known")


class RowColumns(Protocol):
    """Values another part keeps by these rows: set when a request is admitted to a row,
    resized with the rows, and checked against the request by ``BatchRows.check``."""

    def admit(self, row: int, request: Request) -> None: ...

    def grow(self, size: int) -> None: ...

    def check(self, row: int, request: Request) -> None: ...


class BatchRows:
    def __init__(self, max_model_len: int, rows: int = 64,
                 columns: tuple[RowColumns, ...] = ()) -> None:
        self.max_model_len = max_model_len
        self.computed = np.zeros(rows, dtype=np.int64)  # Request.num_computed_tokens
        self.tokens = np.zeros(rows, dtype=np.int64)  # Request.num_tokens (placeholders too)
        self.known = np.zeros(rows, dtype=np.int64)  # Request.num_known_tokens
        self.last = np.zeros(rows, dtype=np.int64)  # all_token_ids[-1] (or PLACEHOLDER)
        self.min_known = np.zeros(rows, dtype=np.int64)
        self.max_known = np.zeros(rows, dtype=np.int64)
        # [rows, K]: the ids that stop the row once min_tokens are out (EOS unless
        # ignore_eos, and stop_token_ids), padded with _NO_TOKEN
        self.stop = np.full((rows, 1), _NO_TOKEN, dtype=np.int64)
        # sampling reads earlier tokens' values on the host (grammar, multi-token bad word)
        self.needs_known = np.zeros(rows, dtype=bool)
        self.item = np.empty(rows, dtype=object)  # the row's decode ScheduledRequest
        self.columns = columns  # others' per-row values (the sampler's constants)
        for column in columns:
            column.grow(rows)

    @property
    def rows(self) -> int:
        return self.computed.shape[0]

    def admit(self, row: int, request: Request, decode_item: Any) -> None:
        """A request starts running in ``row``: its static fields and its counters."""
        if row >= self.rows:
            self._grow(row + 1)
        p = request.params
        self.min_known[row] = request.num_prompt_tokens + p.min_tokens
        self.max_known[row] = min(request.num_prompt_tokens + p.max_tokens, self.max_model_len)
        stops = sorted(request.stop_token_ids | (
            frozenset() if p.ignore_eos else request.eos_token_ids))
        if len(stops) > self.stop.shape[1]:
            wider = np.full((self.rows, len(stops)), _NO_TOKEN, dtype=np.int64)
            wider[:, :self.stop.shape[1]] = self.stop
            self.stop = wider
        self.stop[row] = _NO_TOKEN
        self.stop[row, :len(stops)] = stops
        self.needs_known[row] = request.grammar is not None or request.bans_follow_output
        self.item[row] = decode_item
        for column in self.columns:
            column.admit(row, request)
        self.sync(row, request)

    def sync(self, row: int, request: Request) -> None:
        """Copy the request's counters into its row (after a change made one at a time)."""
        tokens = request.all_token_ids
        self.computed[row] = request.num_computed_tokens
        self.tokens[row] = len(tokens)
        self.known[row] = len(tokens) - request.num_pending
        self.last[row] = tokens[-1]

    def decodes(self, rows: np.ndarray, host: HostTables, block_size: int,
                caching: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(decode, grow, register) masks over ``rows``. A decode row's next step is one
        token and at most one fresh block, and it does not end by length with a token
        pending; of those, ``grow`` rows need that block and ``register`` rows have blocks
        to register in the prefix cache (``BlockManager.cache_full_blocks`` would do
        something). Scheduling a decode row that is neither changes no state
        (``Scheduler._allocate`` would find it so)."""
        computed, tokens = self.computed[rows], self.tokens[rows]
        room = host.length[rows] * block_size  # tokens the row's blocks hold
        decode = (tokens - computed == 1) & (computed > 0) & (tokens <= room + block_size)
        known = self.known[rows]
        if (known != tokens).any():  # Request.will_finish_by_length (a token pending)
            decode &= (known == tokens) | (tokens < self.max_known[rows])
        grow = decode & (tokens > room)
        if not caching:
            return decode, grow, np.zeros_like(decode)
        # for a decode, the blocks it fills never exceed its table (with the fresh one)
        return decode, grow, decode & (known // block_size > host.registered[rows])

    def advance(self, rows: np.ndarray, num_new: np.ndarray, sampled: np.ndarray) -> None:
        """``rows`` computed ``num_new`` tokens; ``sampled`` rows got a placeholder."""
        self.computed[rows] += num_new
        self.tokens[sampled] += 1
        self.last[sampled] = PLACEHOLDER

    def resolve(self, rows: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's oldest placeholder is ``tokens``; returns (stopped, too long) masks:
        ``Request.check_token_stop`` for the whole batch."""
        known = self.known[rows] + 1
        total = self.tokens[rows]
        if (known > total).any():
            raise AssertionError("a token resolved for a row with no pending token")
        self.known[rows] = known
        newest = known == total
        self.last[rows[newest]] = tokens[newest]
        stopped = (self.stop[rows] == tokens[:, None]).any(axis=1)
        stopped &= known >= self.min_known[rows]
        return stopped, known >= self.max_known[rows]

    def _grow(self, rows: int) -> None:
        size = max(rows, 2 * self.rows)
        for name in (*_INT_FIELDS, "needs_known"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
        stop = np.full((size, self.stop.shape[1]), _NO_TOKEN, dtype=np.int64)
        stop[:len(self.stop)] = self.stop
        item = np.empty(size, dtype=object)
        item[:len(self.item)] = self.item
        self.stop, self.item = stop, item
        for column in self.columns:
            column.grow(size)

    def check(self, running: list[Request], host: HostTables) -> None:
        """Raise AssertionError unless every running request's row equals its fields."""
        for request in running:
            row = host.row_of(request.request_id)
            assert row is not None, f"{request.request_id}: running without a row"
            got = (self.computed[row], self.tokens[row], self.known[row], self.last[row])
            want = (request.num_computed_tokens, request.num_tokens,
                    request.num_known_tokens, request.all_token_ids[-1])
            assert got == want, f"{request.request_id}: row {got} != request {want}"
            assert self.item[row].request is request, f"{request.request_id}: decode item"
            for column in self.columns:
                column.check(row, request)
