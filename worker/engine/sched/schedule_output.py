"""What one step computes: ``ScheduledRequest`` per request and the ``SchedulerOutput``.

The output carries its rows twice: as objects (``scheduled``, what most consumers read)
and as arrays in the same order (rows, token counts, which rows sample), which the
runner builds the step's inputs from and the scheduler advances and resolves with,
without a loop over the requests (``batch_rows.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from worker.engine.kv.host_tables import HostTables
from worker.engine.request import Request
from worker.engine.sched.batch_rows import BatchRows

_TABLE_MIN_ROWS = 8  # fewer sampling rows: the sampler asks the row objects


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step (frozen: a running request's decode item is made once,
    at admission, and reused by every step that only decodes it)."""

    request: Request
    num_new_tokens: int  # tokens computed this step: [num_computed, num_computed + n)
    sample: bool  # the chunk reaches the last known token, so a new token is sampled


@dataclass(eq=False)
class SchedulerOutput:
    # Single-token rows first (decodes, by increasing context), then prefill chunks: the
    # attention backend relies on this order to batch decodes in a few calls.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # The same rows as arrays, in ``scheduled`` order (set by ``Scheduler.schedule``; an
    # output built by hand has none, and its consumers derive them): each request's row
    # (``host_tables.py``), the row's ``gen`` then, tokens computed, whether it samples.
    rows: np.ndarray | None = None  # [n] int64
    gens: np.ndarray | None = None  # [n] int64
    num_new: np.ndarray | None = None  # [n] int64
    sample: np.ndarray | None = None  # [n] bool
    batch: BatchRows | None = None  # the scheduler's rows (their counters, newest tokens)
    host: HostTables | None = None  # the block manager's rows (block tables)
    releases: int = -1  # ``host.releases`` then: unchanged, every row is still its request's
    # Speculative decoding: per drafted request, the draft tokens its row computes
    # after its last known token (its ``num_new_tokens`` is 1 + their count)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    _sampling: list[Request] | None = None

    @property
    def num_decodes(self) -> int:
        if self.num_new is not None:
            return int(np.count_nonzero(self.num_new == 1))
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampling(self) -> list[Request]:
        """The requests of the rows that sample, in order (the sampler's rows)."""
        if self._sampling is None:
            if self.sample is not None and bool(self.sample.all()):
                self._sampling = [s.request for s in self.scheduled]
            else:
                self._sampling = [s.request for s in self.scheduled if s.sample]
        return self._sampling

    def needs_known_tokens(self) -> bool:
        """Whether a sampling row reads its request's earlier tokens on the host (a
        grammar, a multi-token bad word), from the rows' flags set at admission."""
        if self.batch is None or self.rows is None or self.sample is None:
            return any(s.sample and _needs_known(s.request) for s in self.scheduled)
        return bool(self.batch.needs_known[self.rows[self.sample]].any())

    def sampling_rows(self) -> np.ndarray | None:
        """The sampling rows' batch rows, in order, for reading values kept by row at
        launch (before ``advance``: the sampler's constants); None without arrays, once a
        row changed hands, or for a few rows (a handful of attribute reads cost less than
        the gathers)."""
        if self.batch is None or self.rows is None or self.sample is None \
                or len(self.sampling) < _TABLE_MIN_ROWS or not self.intact():
            return None
        return self.rows if len(self.sampling) == len(self.rows) else self.rows[self.sample]

    def attach_rows(self, host: HostTables, batch: BatchRows) -> None:
        """Give an output built by hand its arrays, from its requests' rows as they are
        now (a request holding none gets row -1, which is never intact)."""
        found = [host.row_of(s.request.request_id) for s in self.scheduled]
        rows = np.array([-1 if r is None else r for r in found], dtype=np.int64)
        self.gens = np.where(rows >= 0, host.gen[rows], -1)
        self.rows, self.host, self.batch = rows, host, batch
        self.num_new = np.array([s.num_new_tokens for s in self.scheduled], dtype=np.int64)
        self.sample = np.array([s.sample for s in self.scheduled], dtype=bool)
        self.releases = -1 if None in found else host.releases

    def intact(self) -> bool:
        """Whether every row still belongs to the request it was scheduled for (none
        finished or was preempted since): the arrays may be used as they are."""
        if self.rows is None or self.gens is None or self.host is None:
            return False
        return self.releases == self.host.releases \
            or bool((self.host.gen[self.rows] == self.gens).all())

    def valid_sampling_rows(self) -> np.ndarray:
        """Per sampling row: whether its row still belongs to its request (False for all
        without arrays)."""
        n = len(self.sampling)
        if self.rows is None or self.gens is None or self.sample is None or self.host is None:
            return np.zeros(n, dtype=bool)
        if self.releases == self.host.releases:
            return np.ones(n, dtype=bool)  # no row changed hands since
        sampled = self.sample
        return self.host.gen[self.rows[sampled]] == self.gens[sampled]  # type: ignore[no-any-return]


def _needs_known(request: Request) -> bool:
    return request.grammar is not None or request.bans_follow_output


@dataclass(eq=False)
class Resolved:
    """What ``Scheduler.resolve_sampled`` read back: the sampling rows that got a token."""

    index: np.ndarray  # [m] int64: each one's position among the step's sampling rows
    requests: list[Request]  # [m] (some finished by their token: ``is_finished``)
    tokens: list[int]  # [m]
    ended: list[int] = field(default_factory=list)  # positions in ``requests`` it finished

