"""The running requests' part of one ``Scheduler.schedule``, in priority order.

Runs of rows that only decode (``BatchRows.decodes``: one token, at most one fresh block)
are taken whole, as array slices: a row among them that enters a fresh block or fills one
for the prefix cache gets that done in place, in order, by the same block-manager calls
``Scheduler._allocate`` makes. Any other row (a prefill chunk, a request back from
preemption, a decode with no free block left) goes through ``Scheduler._allocate`` on its
own, and may preempt the lowest-priority rows from the end. The result
is the step's rows as ``ScheduledRequest`` objects and as arrays (``finish``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from worker.engine.config import SchedulerConfig
from worker.engine.kv.block_manager import BlockManager
from worker.engine.request import Request
from worker.engine.sched.batch_rows import BatchRows
from worker.engine.sched.schedule_output import ScheduledRequest, SchedulerOutput


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
