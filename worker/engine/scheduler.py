"""Iteration-level scheduler: every step re-decides the whole batch.

``schedule()`` picks, for this step, how many new tokens each request computes:
running requests first (decodes and unfinished prefill chunks), then waiting requests
while blocks, ``max_num_seqs`` and the token budget allow. ``update()`` applies the
sampled tokens and finishes requests, freeing their blocks in the same step; when steps
overlap it is split into ``advance`` (at launch) and ``resolve`` (at read-back). No I/O
and no tensors here: the scheduler is tested on CPU with fake runner output.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.config import SchedulerConfig
from worker.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step: [num_computed, num_computed + n)
    sample: bool  # the chunk reaches the last known token, so a new token is sampled


@dataclass
class SchedulerOutput:
    # Single-token rows first (decodes, by increasing context), then prefill chunks: the
    # attention backend relies on this order to batch decodes in a few calls.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

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
        else:
            self.waiting.remove(request)
        request.drop_pending()
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.block_manager.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        self.running.sort(key=Request.sort_key)
        pending = list(self.running)  # highest priority first; victims come off the end
        while pending and budget > 0:
            request = pending.pop(0)
            if request.will_finish_by_length(self.max_model_len):
                continue  # ends when its pending token is read back: nothing to compute
            while (item := self._allocate(request, budget)) is None:
                victim = pending.pop() if pending else request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(item)
                budget -= item.num_new_tokens
        if not out.preempted:
            budget = self._admit(scheduled, budget)
        # Decodes first, shortest context first: attention then reads them in length
        # buckets that are contiguous slices, with little padding.
        scheduled.sort(key=lambda s: (s.num_new_tokens != 1, s.num_new_tokens == 1
                                      and s.request.num_tokens))
        out.scheduled = scheduled
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

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
        num_new = min(request.num_tokens - start, budget,
                      self.config.long_prefill_token_threshold)
        if bm.allocate_slots(request.request_id, start + num_new, admitting=admitting,
                             cached=hits) is None:
            return None
        if request.num_computed_tokens == 0 and bm.enable_caching:
            bm.stats.queries += request.num_tokens
        bm.stats.hits += hit_tokens
        request.num_computed_tokens = start
        bm.cache_full_blocks(request, start + num_new)
        return self._scheduled(request, num_new)

    def _admit(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Admit waiting requests, highest priority first, while room allows; a waiting
        request of strictly higher priority than a running one preempts it for room."""
        skip = 0  # [structured output] requests waiting for their grammar keep their place
        while len(self.waiting) > skip and budget > 0:
            request = self.waiting[skip]
            if request.waiting_for_grammar or request.num_pending:
                skip += 1  # a grammar to compile, or a token still being read back
                continue
            item = None
            if len(self.running) < self.config.max_num_seqs:
                item = self._allocate(request, budget, admitting=True)
            if item is None:
                refund = self._preempt_for(request, scheduled)
                if refund is None:
                    break
                budget += refund
                continue
            self.waiting.pop(skip)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
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
        reaches_end = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, sample=reaches_end)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, go back to waiting, keep outputs."""
        self.block_manager.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=Request.sort_key)

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
        for item in output.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_new_tokens
            if item.sample:
                request.append_placeholder()

    def resolve(
        self, output: SchedulerOutput, sampled: Sequence[int | None]
    ) -> list[tuple[Request, int]]:
        """Fill an advanced step's placeholders with its sampled tokens and finish on
        token-level stops. ``sampled`` is aligned with ``output.scheduled`` (None where
        nothing was sampled). Returns (request, token) for every request that got a token
        (a request finished meanwhile has dropped its placeholders and gets none).
        """
        new_tokens: list[tuple[Request, int]] = []
        for item, token in zip(output.scheduled, sampled, strict=True):
            request = item.request
            if request.is_finished or not item.sample or token is None:
                continue
            request.resolve_placeholder(token)
            new_tokens.append((request, token))
            reason = request.check_token_stop(token, self.max_model_len)
            if reason is not None:
                self.finish(request, reason)
        return new_tokens
