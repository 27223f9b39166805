"""Iteration-level scheduler: every step re-decides the whole batch.

``schedule()`` picks, for this step, how many new tokens each request computes:
running requests first (decodes and unfinished prefill chunks), then waiting requests
while blocks, ``max_num_seqs`` and the token budget allow. ``update()`` applies the
sampled tokens and finishes requests, freeing their blocks in the same step; when steps
overlap it is split into ``advance`` (at launch) and ``resolve`` (at read-back). No I/O
and no tensors here: the scheduler is tested on CPU with fake runner output.

The running requests' counters are also kept as arrays, one row per request
(``batch_rows.py``), so that a large batch of decodes is scheduled, advanced and checked
for its stops without a Python loop over requests (``running_walk.py``,
``resolve_sampled``); ``check_invariants`` proves the arrays equal the requests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from worker.engine.batch_rows import BatchRows
from worker.engine.block_manager import BlockManager
from worker.engine.config import SchedulerConfig
from worker.engine.lora.gate import AdapterGate
from worker.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
    advance_decodes,
    resolve_placeholders,
)
from worker.engine.running_walk import RunningWalk
from worker.engine.schedule_output import Resolved, ScheduledRequest, SchedulerOutput

__all__ = ["Resolved", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []  # kept sorted by Request.sort_key too
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.batch = BatchRows(max_model_len)  # the running requests' counters, by row
        self._running_rows: np.ndarray | None = None  # rows in ``running`` order (cache)
        self.adapters: AdapterGate | None = None  # multi-LoRA: slots pinned while running
        # Speculative decoding: drafts for running decode rows, set before ``schedule``
        # (which takes them: a drafted row is scheduled as 1 + len(draft) tokens)
        self.drafts: dict[str, list[int]] = {}

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
        hit_tokens = len(hits) * bm.block_size
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

    # -- after the forward ---------------------------------------------------------------
    def update(
        self, output: SchedulerOutput, sampled: Sequence[int | None]
    ) -> list[tuple[Request, int]]:
        """``advance`` then ``resolve``: one step whose tokens are known at once."""
        self.advance(output)
        return self.resolve(output, sampled)

    def advance(self, output: SchedulerOutput) -> None:
        """The step is launched: its tokens count as computed, and each sampling row gets a
        placeholder for the token it is sampling (so the next step can be scheduled
        before this one is read back)."""
        if output.rows is None:  # built by hand (or filtered): its requests' rows now
            output.attach_rows(self.block_manager.host, self.batch)
        if not (output.host is self.block_manager.host and output.intact()):
            for item in output.scheduled:  # one at a time: rows changed hands, or none
                if not item.request.is_finished:
                    item.request.num_computed_tokens += item.num_new_tokens
                    if item.sample:
                        item.request.append_placeholder()
                    self._sync(item.request)
            return
        assert output.rows is not None and output.num_new is not None \
            and output.sample is not None
        self.batch.advance(output.rows, output.num_new, output.rows[output.sample])
        if len(output.sampling) == len(output.scheduled) == output.num_batched_tokens:
            advance_decodes(output.sampling)  # every row: one token, sampled
            return
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for request in output.sampling:
            request.append_placeholder()

    def resolve(
        self, output: SchedulerOutput, sampled: Sequence[int | None]
    ) -> list[tuple[Request, int]]:
        """Fill an advanced step's placeholders with its sampled tokens and finish on
        token-level stops. ``sampled`` is aligned with ``output.scheduled`` (None where
        nothing was sampled). Returns (request, token) for every request that got a token
        (a request finished meanwhile has dropped its placeholders and gets none).
        ``resolve_sampled`` does the same from the sampler's tokens alone, faster.
        """
        if len(sampled) != len(output.scheduled):
            raise ValueError(f"{len(sampled)} tokens for {len(output.scheduled)} rows")
        if len(output.sampling) == len(sampled):  # every row samples
            tokens = list(sampled)
        else:
            tokens = [t for s, t in zip(output.scheduled, sampled, strict=True) if s.sample]
        if None in tokens:  # a sampling row without its token gets none
            output = SchedulerOutput([s for s, t in zip(output.scheduled, sampled, strict=True)
                                      if s.sample and t is not None])
            tokens = [t for t in tokens if t is not None]
        got = self.resolve_sampled(output, tokens)  # type: ignore[arg-type]
        return list(zip(got.requests, got.tokens, strict=True))

    def resolve_sampled(
        self, output: SchedulerOutput, tokens: Sequence[int] | np.ndarray
    ) -> Resolved:
        """``resolve`` for ``tokens``, one per sampling row of ``output`` in order (what the
        sampler returns, fastest as an int64 array; ``output.sampling`` are their
        requests). Returns the rows that got their token (``Resolved.index`` into
        ``tokens``), their requests and tokens; a request that ends on its token (EOS, stop
        ids, ``max_tokens``, the model's context) is finished by then. The checks run over
        arrays (``BatchRows.resolve``) for every row still held by its request, one
        request at a time for the others (finished or preempted since, or no arrays)."""
        if output.rows is None:  # built by hand (or filtered): its requests' rows now
            output.attach_rows(self.block_manager.host, self.batch)
        requests = output.sampling
        values = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(values) != len(requests):
            raise ValueError(f"{len(values)} tokens for {len(requests)} sampling rows")
        token_list: list[int] = tokens if isinstance(tokens, list) else values.tolist()
        valid = output.valid_sampling_rows() if output.host is self.block_manager.host \
            else np.zeros(len(requests), dtype=bool)
        stops: dict[int, FinishReason] = {}
        got = valid.copy()
        for i in (~valid).nonzero()[0].tolist():
            request = requests[i]
            if not request.is_finished:
                got[i] = True
                request.resolve_placeholder(token_list[i])
                self._sync(request)  # still running (an output without arrays): its row too
                reason = request.check_token_stop(token_list[i], self.max_model_len)
                if reason is not None:
                    stops[i] = reason
        fast = valid.nonzero()[0]
        if len(fast):
            assert output.rows is not None and output.sample is not None
            rows, pairs = output.rows[output.sample], (requests, token_list)
            if len(fast) != len(requests):
                rows, values = rows[valid], values[valid]
                pairs = ([requests[i] for i in fast.tolist()],
                         [token_list[i] for i in fast.tolist()])
            stopped, too_long = self.batch.resolve(rows, values)
            resolve_placeholders(*pairs)
            for j in (stopped | too_long).nonzero()[0].tolist():
                i = int(fast[j])
                stops[i] = FinishReason.STOP if stopped[j] else FinishReason.LENGTH
                if stopped[j]:
                    requests[i].note_stop_token(token_list[i])
        for i in sorted(stops):
            self.finish(requests[i], stops[i])
        index = got.nonzero()[0]
        if len(index) == len(requests):
            return Resolved(index, requests, token_list)
        return Resolved(index, [requests[i] for i in index.tolist()],
                        [token_list[i] for i in index.tolist()])
