"""What one step computes, and the walk over the running requests that builds most of it.

``ScheduledRequest`` per request and the ``SchedulerOutput``: the output carries its rows
twice, as objects (``scheduled``, what most consumers read) and as arrays in the same
order (rows, token counts, which rows sample), which the runner builds the step's inputs
from and the scheduler advances and resolves with, without a loop over the requests
(``batch_rows.py``).

``RunningWalk`` is the running requests' part of one ``Scheduler.schedule``, in priority
order, and fills the output (``finish``). Runs of rows that only decode
(``BatchRows.decodes``: one token, at most one fresh block) are taken whole, as array
slices: a row among them that enters a fresh block or fills one for the prefix cache gets
that done in place, in order, by the same block-manager calls ``Scheduler._allocate``
makes. Any other row (a prefill chunk, a request back from preemption, a decode with no
free block left) goes through ``Scheduler._allocate`` on its own, and may preempt the
lowest-priority rows from the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from worker.engine.config import SchedulerConfig
from worker.engine.kv.block_manager import BlockManager
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


class Scheduling(Protocol):
    """What the walk uses of ``Scheduler`` (which imports this module)."""

    config: SchedulerConfig
    block_manager: BlockManager
    batch: BatchRows
    running: list[Request]
    max_model_len: int
    num_preemptions: int
    drafts: dict[str, list[int]]

    def rows_of_running(self) -> np.ndarray: ...

    def _allocate(self, request: Request, budget: int,
                  admitting: bool = False) -> ScheduledRequest | None: ...

    def _preempt(self, request: Request) -> None: ...

_LAST = np.iinfo(np.int64).max  # the sort key of a prefill chunk: after every decode


class RunningWalk:
    """One step's walk over the running requests; ``finish`` adds the admitted ones."""

    def __init__(self, sched: Scheduling) -> None:
        self.sched = sched
        self.scheduled: list[ScheduledRequest] = []
        n = len(sched.running)
        self.rows = np.empty(n, dtype=np.int64)  # [k] of the scheduled, in walk order
        self.new = np.ones(n, dtype=np.int64)
        self.sample = np.ones(n, dtype=bool)
        self.k = 0
        self.preemptions = 0
        self.grow: list[bool] = []  # per running row: a decode entering a fresh block
        self.register: list[bool] = []  # ...a decode with blocks to register
        self.row_list: list[int] = []  # running rows, as ints

    def run(self, out: SchedulerOutput, budget: int) -> int:
        s, bm = self.sched, self.sched.block_manager
        running = list(s.running)  # highest priority first; victims come off the end
        rows = s.rows_of_running()
        if s.config.long_prefill_token_threshold >= 1 and len(running):
            decode, grow, register = s.batch.decodes(rows, bm.host, bm.block_size,
                                                     bm.enable_caching)
            if s.drafts:  # a drafted row computes 1 + k tokens: the general path
                plain = np.array([r.request_id not in s.drafts for r in running])
                decode, grow, register = decode & plain, grow & plain, register & plain
            general = (~decode).nonzero()[0].tolist()
            extras = (grow | register).nonzero()[0].tolist()
            self.grow, self.register = grow.tolist(), register.tolist()
            self.row_list = rows.tolist() if extras else []
        else:
            general, extras = list(range(len(running))), []
        i, end, g, e, k = 0, len(running), 0, 0, 0
        while i < end and budget > 0:
            while g < len(general) and general[g] < i:
                g += 1
            j = min(general[g] if g < len(general) else end, end, i + budget)
            while e < len(extras) and extras[e] < i:
                e += 1
            last = e
            while last < len(extras) and extras[last] < j:
                last += 1
            if last > e:  # in order: a fresh block, blocks to register
                todo = extras[e:last]
                done = bm.grow_decodes([running[p] for p in todo], [self.row_list[p] for p in todo],
                                       [self.grow[p] for p in todo],
                                       [self.register[p] for p in todo])
                e += done
                if done < len(todo):
                    j = todo[done]  # no free block: that row takes the general path
            if j > i:  # rows i..j-1 decode one token each
                seg = rows[i:j]
                self.rows[k:k + j - i] = seg
                self.scheduled.extend(s.batch.item[seg].tolist())
                k, budget, i = k + j - i, budget - (j - i), j
                continue
            request = running[i]
            i += 1
            if request.will_finish_by_length(s.max_model_len):
                continue  # ends when its pending token is read back: nothing to compute
            while (item := s._allocate(request, budget)) is None:
                if end > i:
                    end -= 1
                    victim = running[end]
                else:
                    victim = request
                s._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.rows[k], self.new[k], self.sample[k] = rows[i - 1], \
                    item.num_new_tokens, item.sample
                self.scheduled.append(item)
                k += 1
                budget -= item.num_new_tokens
        self.k = k
        self.preemptions = s.num_preemptions
        return budget

    def finish(self, out: SchedulerOutput) -> None:
        """Fill ``out``: the rows in order (decodes first, shortest context first: attention
        then reads them in length buckets that are contiguous slices), with arrays."""
        s, host = self.sched, self.sched.block_manager.host
        items, k = self.scheduled, self.k
        rows, new, sample = self.rows[:k], self.new[:k], self.sample[:k]
        if s.num_preemptions != self.preemptions:  # admission preempted: rebuild
            items, k = items[:0] + items, 0
            rows, new, sample = rows[:0], new[:0], sample[:0]
        if len(items) > k:  # admitted requests (or everything, rebuilt)
            extra = items[k:]
            rows = np.concatenate([rows, np.array(
                [host.row_of(it.request.request_id) for it in extra], dtype=np.int64)])
            new = np.concatenate([new, np.array([it.num_new_tokens for it in extra],
                                                dtype=np.int64)])
            sample = np.concatenate([sample, np.array([it.sample for it in extra], dtype=bool)])
        key = np.where(new == 1, s.batch.tokens[rows], _LAST)
        if len(key) > 1 and bool((key[1:] < key[:-1]).any()):
            perm = np.argsort(key, kind="stable")
            items = [items[p] for p in perm.tolist()]
            rows, new, sample = rows[perm], new[perm], sample[perm]
        out.scheduled = items
        out.rows, out.gens, out.num_new, out.sample = rows, host.gen[rows], new, sample
        out.batch, out.host, out.releases = s.batch, host, host.releases
