"""The scheduler's half after the forward: a step's sampled tokens applied to its requests.

``advance`` runs at launch (tokens count as computed, sampling rows get placeholders),
``resolve_sampled`` at read-back (placeholders filled, token-level stops checked over the
batch's arrays, requests finished); ``advance_resolve`` is the two at once for a step read
back at once, with a faster path when every row is a plain decode. A mixin of
``Scheduler``, apart from the admission half so that each reads on its own. The bulk
forms of ``Request``'s per-token updates (``advance_decodes``, ``resolve_placeholders``,
``append_decodes``: one pass over a batch, no call per request) are here, with their one
caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from worker.engine.kv.block_manager import BlockManager
from worker.engine.request import PLACEHOLDER, FinishReason, Request
from worker.engine.sched.batch_rows import BatchRows
from worker.engine.sched.schedule_output import Resolved, SchedulerOutput


class StepUpdates:
    """Reads and writes the ``Scheduler``'s state: its block manager, batch arrays and
    model length; finishes through ``finish`` and re-syncs a row through ``_sync``."""

    block_manager: BlockManager
    batch: BatchRows
    max_model_len: int

    if TYPE_CHECKING:  # the Scheduler's own methods, declared for the type checker only
        def finish(self, request: Request, reason: FinishReason,
                   error: str | None = None) -> None: ...

        def _sync(self, request: Request) -> None: ...

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

    def extend_known(self, request: Request, tokens: list[int]) -> None:
        """``tokens`` computed and known at once, after the request's last token (a verified
        speculative run): the counters and the row that ``advance`` + ``resolve`` of
        one single-token step per token would leave, with no stop check (the caller's)."""
        assert request.num_pending == 0, f"{request.request_id}: a token is pending"
        request.num_computed_tokens += len(tokens)
        request.output_token_ids += tokens
        request.all_token_ids += tokens
        self._sync(request)

    def advance_resolve(self, output: SchedulerOutput, tokens: list[int]) -> Resolved:
        """``advance`` then ``resolve_sampled`` for a step read back at once (no overlap).
        When every row is a decode that samples, still its request's, with no token
        pending, each token goes straight into its request (``append_decodes``) and the
        rows' arrays move as the two would move them."""
        rows, batch = output.rows, self.batch
        if rows is None or output.num_new is None or output.host is not \
                self.block_manager.host or not output.intact() or not \
                len(output.sampling) == len(output.scheduled) == output.num_batched_tokens \
                or bool((batch.known[rows] != batch.tokens[rows]).any()):
            self.advance(output)
            return self.resolve_sampled(output, tokens)
        requests = output.sampling
        if len(tokens) != len(requests):
            raise ValueError(f"{len(tokens)} tokens for {len(requests)} sampling rows")
        batch.advance(rows, output.num_new, rows)
        stopped, too_long = batch.resolve(rows, np.asarray(tokens, dtype=np.int64))
        append_decodes(requests, tokens)
        ended = (stopped | too_long).nonzero()[0].tolist()
        for i in ended:
            if stopped[i]:
                requests[i].note_stop_token(tokens[i])
            self.finish(requests[i], FinishReason.STOP if stopped[i] else FinishReason.LENGTH)
        return Resolved(np.arange(len(requests)), requests, tokens, ended)

    def resolve_sampled(
        self, output: SchedulerOutput, tokens: Sequence[int] | np.ndarray
    ) -> Resolved:
        """Fill an advanced step's placeholders with ``tokens``, one per sampling row of
        ``output`` in order (what the sampler returns, fastest as an int64 array;
        ``output.sampling`` are their requests). Returns the rows that got their token
        (``Resolved.index`` into ``tokens``), their requests and tokens; a request that
        ends on its token (EOS, stop ids, ``max_tokens``, the model's context) is finished
        by then. The checks run over arrays (``BatchRows.resolve``) for every row still
        held by its request, one request at a time for the others (finished or preempted
        since, or no arrays)."""
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
        ended = sorted(stops)
        for i in ended:
            self.finish(requests[i], stops[i])
        index = got.nonzero()[0]
        if len(index) == len(requests):
            return Resolved(index, requests, token_list, ended)
        return Resolved(index, [requests[i] for i in index.tolist()],
                        [token_list[i] for i in index.tolist()],
                        np.searchsorted(index, ended).tolist())


def advance_decodes(requests: list[Request]) -> None:
    """Each request computed one token and sampled the next: ``num_computed_tokens += 1``
    and ``append_placeholder``, inlined (one pass over the batch, no call per request)."""
    for r in requests:
        r.num_computed_tokens += 1
        r.output_token_ids.append(PLACEHOLDER)
        r.all_token_ids.append(PLACEHOLDER)
        r.num_pending += 1


def resolve_placeholders(requests: list[Request], tokens: list[int]) -> None:
    """``resolve_placeholder`` for each (request, token), inlined; the caller has checked
    that each has a pending token (``BatchRows.resolve``)."""
    for r, token in zip(requests, tokens, strict=True):
        pending = r.num_pending
        r.output_token_ids[-pending] = token
        r.all_token_ids[-pending] = token
        r.num_pending = pending - 1


def append_decodes(requests: list[Request], tokens: list[int]) -> None:
    """``advance_decodes`` then ``resolve_placeholders`` for a step read back at once (no
    overlap): each request computed one token and its sampled one goes straight in, with
    no placeholder between (one pass over the batch, not two)."""
    for r, token in zip(requests, tokens, strict=True):
        r.num_computed_tokens += 1
        r.output_token_ids.append(token)
        r.all_token_ids.append(token)
