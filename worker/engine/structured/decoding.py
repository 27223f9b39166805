"""Constrained decoding: per-request matchers and the step's masks (compiles: grammar_compiler.py).

The grammar engine is llguidance (docs/engine.md says why). Each distinct constraint is
compiled once, on a worker thread, into a *pristine* matcher; requests get a copy of it,
so a request never waits on the engine loop and the loop never waits on a compile. A
request's matcher is a function of its output tokens: ``sync`` consumes what it has not
seen (the tokens a crashed worker already streamed, ``prior_output_ids``, come first) and
rolls back or rebuilds when the output shrank, so preemption and resumption cannot put it
out of step. Masks are computed for the constrained rows of a step only, in one parallel
call into llguidance (the GIL is released), and applied by
``logits_processors.apply_token_bitmask``. A speculative row's draft is cut where
the grammar rejects it (``valid_draft``), and its row gets one mask per position, each
from the state after the drafts before it; the matcher ends where it began.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import torch

from worker.engine.request import FinishReason, Request
from worker.engine.structured.call_budget import CallBudget
from worker.engine.structured.compiler import GrammarCompiler


class RequestGrammar:
    """One request's matcher, kept in step with the request's output tokens (and, for a
    list of parallel calls, where its calls ended: ``call_budget.py``)."""

    def __init__(self, future: cf.Future[Any], budget: CallBudget | None = None) -> None:
        self.future = future
        self._pristine: Any = None
        self.matcher: Any = None
        self.consumed = 0  # output tokens the matcher has accepted
        self.error: str | None = None
        self.budget = budget

    @property
    def ready(self) -> bool:
        """Compiled and in step: the scheduler may admit the request."""
        return self.matcher is not None and self.error is None

    def poll(self, output_ids: list[int]) -> bool:
        """Once the compile is done: take a copy and catch up with ``output_ids``.

        Returns True when something changed (ready, or failed: see ``error``).
        """
        if self.matcher is not None or self.error is not None or not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            return True
        self._pristine = self.future.result()
        self.matcher = self._pristine.deep_copy()
        self.sync(output_ids)
        if self.error is not None:
            self.error = f"prior_output_ids: {self.error}"
        return True

    def sync(self, output_ids: list[int]) -> None:
        """Make the matcher's state the one after exactly ``output_ids``."""
        if self.matcher is None or self.error is not None:
            return
        if len(output_ids) < self.consumed:
            back = self.consumed - len(output_ids)
            if self.budget is not None or not self.matcher.rollback(back):
                self.matcher, self.consumed = self._pristine.deep_copy(), 0
                self.budget = self.budget.fresh() if self.budget is not None else None
            else:
                self.consumed -= back
        new = output_ids[self.consumed:]
        if new and not self._consume(new):
            self.error = "the grammar does not accept the output: " + " ".join(
                self.matcher.get_error().split())[:300]
        self.consumed = len(output_ids)

    def _consume(self, tokens: list[int]) -> bool:
        if self.budget is None:
            return bool(self.matcher.consume_tokens(tokens))
        for i, token in enumerate(tokens, self.consumed + 1):  # where each call ends
            if not self.matcher.consume_token(token):
                return False
            self.budget.step(i, bool(self.matcher.is_accepting()))
        return True

    def fill_masks(self, draft: list[int], ptr: int, row_bytes: int) -> None:
        """On a filler thread: the mask before each draft token and the one after the
        last, in consecutive rows from ``ptr``; then back to the state it began in (the
        verified tokens are consumed later by ``sync``, the rejected ones never)."""
        matcher = self.matcher
        budget = self.budget.copy() if self.budget is not None else None
        ok = True
        for j, token in enumerate(draft):
            self._mask(ptr + j * row_bytes, row_bytes, budget, self.consumed + j)
            ok = ok and matcher.consume_token(token)  # valid: ``valid_draft`` cut it
            if budget is not None:
                budget.step(self.consumed + j + 1, bool(matcher.is_accepting()))
        self._mask(ptr + len(draft) * row_bytes, row_bytes, budget,
                   self.consumed + len(draft))
        if draft and not (ok and matcher.rollback(len(draft))):
            self.matcher, self.consumed = self._pristine.deep_copy(), 0  # sync catches up
            self.budget = self.budget.fresh() if self.budget is not None else None

    def _mask(self, ptr: int, row_bytes: int, budget: CallBudget | None,
              length: int) -> None:
        """The mask after ``length`` output tokens: the grammar's, or EOS alone where a
        list of calls must end (``CallBudget.must_end``)."""
        self.matcher.unsafe_compute_mask_ptr(ptr, row_bytes)
        if budget is not None and budget.must_end(length):
            budget.end_only(ptr, row_bytes)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing may follow (EOS included, or its end)."""
        return self.matcher is not None and bool(self.matcher.is_stopped())


class StructuredOutputs:
    """What the engine calls: attach, poll, masks, advance. Everything for one engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 mask_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        # Requests whose grammar is still compiling: the engine reads it to skip ``poll``
        self.pending: list[Request] = []
        # Masks are filled on these threads while the forward runs (llguidance drops the
        # GIL): with overlap, step N+1's while its forward runs and step N is read back.
        self._threads = mask_threads
        self._filler = cf.ThreadPoolExecutor(mask_threads, thread_name_prefix="ferry-mask")
        self._inflight: list[cf.Future[Any]] = []

    def attach(self, request: Request) -> None:
        spec = request.params.structured_output
        if spec is None:
            return
        request.grammar = RequestGrammar(self.compiler.compile(spec),
                                         CallBudget.of(request.params, self._eos))
        self.pending.append(request)

    def poll(self) -> list[Request]:
        """Requests whose compile finished since the last call and failed (to be finished)."""
        failed, still = [], []
        for request in self.pending:
            grammar = request.grammar
            if request.is_finished or grammar is None:
                continue
            grammar.poll(request.known_output_ids)
            if grammar.error is not None:
                failed.append(request)
            elif not grammar.ready:
                still.append(request)
        self.pending = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` for a pending compile: the loop has nothing else to do."""
        futures = [r.grammar.future for r in self.pending if r.grammar is not None]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def start_bitmask(self, requests: list[Request],
                      drafts: dict[str, list[int]] | None = None) -> PendingMask:
        """Start filling the masks of the constrained rows among ``requests`` (the rows that
        sample, in order) on the filler threads, so it overlaps the forward pass.

        ``drafts`` (speculative decoding): a drafted request's k draft positions sample
        from logits rows after all of ``requests``' (in order, as ``engine_hooks``), its
        own row at the bonus position; each gets the mask after the drafts before it."""
        self._settle()
        if not drafts and not any(r.grammar is not None for r in requests):
            return PendingMask([], None)  # the usual step: no row is constrained
        drafts = drafts or {}
        rows: list[int] = []  # logits row of each bitmask row
        jobs: list[tuple[RequestGrammar, list[int], int]] = []  # grammar, draft, first row
        extra = len(requests)
        for i, request in enumerate(requests):
            draft = drafts.get(request.request_id, [])
            if request.grammar is not None and not request.is_finished:  # finished: dropped
                request.grammar.sync(request.known_output_ids)
                jobs.append((request.grammar, draft, len(rows)))
                rows += [*range(extra, extra + len(draft)), i]
            extra += len(draft)
        if not rows:
            return PendingMask(rows, None)
        bitmask = torch.empty((len(rows), (self.vocab_size + 31) // 32),
                              dtype=torch.int32)  # [R, W]
        size = -(-len(jobs) // min(self._threads, len(jobs)))
        self._inflight = [self._filler.submit(_fill, jobs[lo:lo + size], bitmask)
                          for lo in range(0, len(jobs), size)]
        return PendingMask(rows, bitmask, self._inflight)

    def valid_draft(self, request: Request, draft: list[int]) -> int:
        """How many of ``draft``'s first tokens the request's grammar accepts after its
        known output (all of them without a grammar); the matcher's state is unchanged."""
        grammar = request.grammar
        if grammar is None:
            return len(draft)
        self._settle()
        grammar.sync(request.known_output_ids)
        return int(grammar.matcher.validate_tokens(draft)) if grammar.ready else 0

    def _settle(self) -> None:
        """Matchers are not touched while a fill runs (a failed forward skips the wait)."""
        if self._inflight:
            cf.wait(self._inflight)
            self._inflight = []

    def advance(self, request: Request) -> tuple[FinishReason, str | None] | None:
        """After a token: the finish the grammar implies (its end, or an error), if any."""
        grammar = request.grammar
        if grammar is None or request.is_finished:
            return None
        self._settle()
        grammar.sync(request.known_output_ids)
        if grammar.error is not None:
            return FinishReason.ERROR, grammar.error
        if grammar.stopped:
            return FinishReason.STOP, None
        return None

    def close(self) -> None:
        self._settle()
        self._filler.shutdown(wait=False)
        self.compiler.close()


def _fill(jobs: list[tuple[RequestGrammar, list[int], int]], bitmask: torch.Tensor) -> None:
    """Some requests' masks on a filler thread (each llguidance call drops the GIL): a
    request's 1 + k rows start at its job's first row (``RequestGrammar.fill_masks``).

    Plain loops on our own threads, not llguidance's parallel executor: its worker threads
    spin after each batch and, on a small CPU, steal the cores the sampler's tensor ops
    run on next.
    """
    row_bytes = bitmask.shape[1] * 4
    for grammar, draft, first in jobs:
        grammar.fill_masks(draft, bitmask.data_ptr() + first * row_bytes, row_bytes)


class PendingMask:
    """The masks of one step, being filled; ``get()`` waits for them (None: no grammar)."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor | None,
                 futures: list[cf.Future[Any]] | None = None) -> None:
        self.rows = rows
        self.bitmask = bitmask
        self.futures = futures or []

    def get(self) -> tuple[list[int], torch.Tensor] | None:
        if self.bitmask is None:
            return None
        for future in self.futures:
            future.result()  # re-raises a failed fill
        return self.rows, self.bitmask
