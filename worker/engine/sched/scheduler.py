"""Iteration-level scheduler: every step re-decides the whole batch.

``schedule()`` picks, for this step, how many new tokens each request computes:
running requests first (decodes and unfinished prefill chunks), then waiting requests
while blocks, ``max_num_seqs`` and the token budget allow. ``update()`` applies the
sampled tokens and finishes requests, freeing their blocks in the same step; when steps
overlap it is split into ``advance`` (at launch) and ``resolve`` (at read-back). No I/O
and no tensors here: the scheduler is tested on CPU with fake runner output.

The running requests' counters are also kept as arrays, one row per request
(``batch_rows.py``), so that a large batch of decodes is scheduled, advanced and checked
for its stops without a Python loop over requests (``schedule_output.RunningWalk``,
``resolve_sampled``); ``check_invariants`` proves the arrays equal the requests.
"""

from __future__ import annotations

import bisect

import numpy as np

from worker.engine.config import SchedulerConfig
from worker.engine.kv.block_manager import BlockManager
from worker.engine.lora.gate import AdapterGate
from worker.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
)
from worker.engine.sched.batch_rows import BatchRows, RowColumns
from worker.engine.sched.schedule_output import (
    Resolved,
    RunningWalk,
    ScheduledRequest,
    SchedulerOutput,
)
from worker.engine.sched.updates import StepUpdates

__all__ = ["Resolved", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler(StepUpdates):
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
        columns: tuple[RowColumns, ...] = (),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []  # kept sorted by Request.sort_key too
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # the running requests' counters, by row; ``columns``: others' values by the rows
        self.batch = BatchRows(max_model_len, columns=columns)
        self._running_rows: np.ndarray | None = None  # rows in ``running`` order (cache)
        self.adapters: AdapterGate | None = None  # multi-LoRA: slots pinned while running
        # Speculative decoding: drafts for running decode rows, set before ``schedule``
        # (which takes them: a drafted row is scheduled as 1 + len(draft) tokens)
        self.drafts: dict[str, list[int]] = {}
        # Requests scheduled for the first time since ``take_first_scheduled``: their
        # ``num_cached_tokens`` is now known (the usage a caller is shown)
        self.first_scheduled: list[Request] = []

    # -- membership --------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def abort(self, request_id: str) -> Request | None:
        """Remove a waiting or running request now; returns it, or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._running_rows = None
        else:
            self.waiting.remove(request)
        request.drop_pending()
        if self.adapters is not None:
            self.adapters.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        if reason in (FinishReason.STOP, FinishReason.LENGTH):  # every position computed
            self.block_manager.free_keeping_partial(request)
        else:
            self.block_manager.free(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_invariants(self) -> None:
        """Raise AssertionError if the rows disagree with the requests (used by tests)."""
        self.block_manager.check_invariants()
        self.batch.check(self.running, self.block_manager.host)
        assert self.running == sorted(self.running, key=Request.sort_key)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.begin_step()
        budget = self.config.max_num_batched_tokens
        walk = RunningWalk(self)
        budget = walk.run(out, budget)
        if not out.preempted:
            budget = self._admit(walk.scheduled, budget)
        walk.finish(out)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if self.drafts:
            out.drafts = {s.request.request_id: self.drafts[s.request.request_id]
                          [:s.num_new_tokens - 1] for s in out.scheduled
                          if s.num_new_tokens > 1 and s.request.request_id in self.drafts}
            self.drafts = {}
        return out

    def take_first_scheduled(self) -> list[Request]:
        """The requests scheduled for the first time since the last call."""
        first, self.first_scheduled = self.first_scheduled, []
        return first

    def rows_of_running(self) -> np.ndarray:
        """The running requests' rows, in ``running`` (priority) order."""
        if self._running_rows is None:
            host = self.block_manager.host
            self._running_rows = np.array(
                [host.row_of(r.request_id) for r in self.running], dtype=np.int64)
        return self._running_rows

    def _allocate(
        self, request: Request, budget: int, admitting: bool = False
    ) -> ScheduledRequest | None:
        """Blocks for the request's next chunk, taking cached blocks first where its
        computed prefix ends at a block boundary; None (nothing changed) if they do not
        fit. A request admitted from scratch counts as a prefix-cache lookup."""
        bm = self.block_manager
        # A request reporting prompt logprobs computes the positions it reports.
        hits = [] if request.needs_prompt_logits else bm.cached_prefix(request)
        hit_tokens = bm.hit_tokens(hits)
        start = request.num_computed_tokens + hit_tokens
        drafted = len(self.drafts.get(request.request_id, ())) if self.drafts else 0
        num_new = min(request.num_tokens + drafted - start, budget,
                      self.config.long_prefill_token_threshold)
        if bm.allocate_slots(request.request_id, start + num_new, admitting=admitting,
                             cached=hits) is None:
            if not drafted:
                return None
            del self.drafts[request.request_id]  # no room for the drafts: decode plainly
            return self._allocate(request, budget, admitting)
        if request.num_computed_tokens == 0 and bm.enable_caching:
            bm.stats.queries += request.num_tokens
        bm.stats.hits += hit_tokens
        if request.num_cached_tokens < 0:  # its first scheduling: what the cache served
            request.num_cached_tokens = min(hit_tokens, request.num_prompt_tokens)
            self.first_scheduled.append(request)
        request.num_computed_tokens = start
        # only known tokens are ever hashed: a draft never enters a registered block
        bm.cache_full_blocks(request, min(start + num_new, request.num_tokens))
        if not admitting:
            self._sync(request)
        return self._scheduled(request, num_new)

    def _sync(self, request: Request) -> None:
        row = self.block_manager.host.row_of(request.request_id)
        if row is not None:
            self.batch.sync(row, request)

    def _admit(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admit waiting requests, highest priority first, while room allows; a waiting
        request of strictly higher priority than a running one preempts it for room."""
        skip = 0  # [structured output] requests waiting for their grammar keep their place
        while len(self.waiting) > skip and budget > 0:
            request = self.waiting[skip]
            if request.waiting_for_grammar or request.num_pending:
                skip += 1  # a grammar to compile, or a token still being read back
                continue
            if self.adapters is not None and not self.adapters.admit(request):
                skip += 1  # every LoRA slot is held by running rows: wait for one
                continue
            item = None
            if len(self.running) < self.config.max_num_seqs:
                item = self._allocate(request, budget, admitting=True)
            if item is None:
                if self.adapters is not None:
                    self.adapters.release(request)
                refund = self._preempt_for(request, scheduled)
                if refund is None:
                    break
                budget += refund
                continue
            self.waiting.pop(skip)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
            self._running_rows = None
            row = self.block_manager.host.row_of(request.request_id)
            assert row is not None
            self.batch.admit(row, request, ScheduledRequest(request, 1, True))
            scheduled.append(item)
            budget -= item.num_new_tokens
        return budget

    def _preempt_for(
        self, request: Request, scheduled: list[ScheduledRequest]
    ) -> int | None:
        """Preempt the lowest-priority running request if ``request`` outranks it; returns
        the token budget that frees this step (None: nothing ranks below ``request``). A
        request computing blocks that others already share this step is passed over."""
        bm = self.block_manager
        candidates = [r for r in self.running if r.priority > request.priority
                      and not bm.provides_this_step(r.request_id)]
        if not candidates:
            return None
        victim = max(candidates, key=Request.sort_key)
        refund = 0
        for item in scheduled:
            if item.request is victim:
                scheduled.remove(item)
                refund = item.num_new_tokens
                bm.forget_step(victim.request_id)  # its blocks will not be computed now
                break
        self._preempt(victim)
        return refund

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledRequest:
        reaches_end = request.num_computed_tokens + num_new >= request.num_tokens
        return ScheduledRequest(request, num_new, sample=reaches_end)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, go back to waiting, keep outputs."""
        self.block_manager.free(request.request_id)
        self.running.remove(request)
        self._running_rows = None
        if self.adapters is not None:
            self.adapters.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=Request.sort_key)
