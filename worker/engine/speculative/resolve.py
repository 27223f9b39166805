"""A verified step's accepted tokens after each row's first, in one pass per row.

Why not one position at a time: a ``SchedulerOutput``, ``Scheduler.advance`` and
``Engine.apply_tokens`` per accepted position was ~21% of a batch-1 retry's CPU time. Here each
row's run is cut at its first finishing token by one scan (``run_length``: the checks of
``Request.check_token_stop``: EOS and stop ids once ``min_tokens`` are out, ``max_tokens``,
the model's context), appended at once (``Scheduler.extend_known``), and its rows go into
the ``StepBatch`` in the order the per-position loop gave them (position-major across
rows), each request finished (``Scheduler.finish``, ``Engine.engine_end``) at the same
point of that order, so the batch, the ends and the order of the store's additions are unchanged.

A row with a grammar still advances its matcher after each token (its state reads the
known output, and a grammar end cuts the run), as a plain step would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.output.step_batch import StepBatch
from worker.engine.request import FinishReason, Request

if TYPE_CHECKING:
    from worker.engine.speculative.host import StepHost

# A row's run: its request, the tokens it takes, the finish its last one implies, the error
Run = tuple[Request, list[int], FinishReason | None, str | None]


def run_length(request: Request, tokens: list[int], max_model_len: int
               ) -> tuple[int, FinishReason | None]:
    """How many of ``tokens`` (following the request's known tokens) it takes, and the
    finish the last of them implies: ``Request.check_token_stop`` token by token, stopping
    at the first that finishes (a stop id counts before a length limit on the same token)."""
    p = request.params
    out = request.num_output_tokens - request.num_pending
    room = max(1, min(p.max_tokens - out, max_model_len - request.num_known_tokens))
    stops, eos = request.stop_token_ids, () if p.ignore_eos else request.eos_token_ids
    for i in range(max(0, p.min_tokens - out - 1), min(len(tokens), room)):
        if tokens[i] in stops or tokens[i] in eos:
            return i + 1, FinishReason.STOP
    if room <= len(tokens):
        return room, FinishReason.LENGTH
    return len(tokens), None


def _grammar_run(engine: StepHost, request: Request, tokens: list[int],
                 reason: FinishReason | None) -> Run:
    """Append ``tokens`` one at a time, the grammar advanced after each but a last one that
    ends the request by a token-level stop (a plain step finishes it before the matcher
    sees it); a grammar end cuts the run there."""
    for j, token in enumerate(tokens):
        engine.scheduler.extend_known(request, [token])
        if j == len(tokens) - 1 and reason is not None:
            break
        end = engine.structured.advance(request)  # [structured output]
        if end is not None:
            return request, tokens[:j + 1], end[0], end[1]
    if reason is FinishReason.STOP:
        request.note_stop_token(tokens[-1])
    return request, tokens, reason, None


def _runs(engine: StepHost, sampling: list[Request], accepted: list[list[int]]) -> list[Run]:
    runs: list[Run] = []
    for request, seq in zip(sampling, accepted, strict=True):
        if len(seq) < 2 or request.is_finished:
            continue
        count, reason = run_length(request, seq[1:], engine.max_model_len)
        tokens = seq[1:1 + count]
        if request.grammar is not None:
            runs.append(_grammar_run(engine, request, tokens, reason))
            continue
        engine.scheduler.extend_known(request, tokens)
        if reason is FinishReason.STOP:
            request.note_stop_token(tokens[-1])
        runs.append((request, tokens, reason, None))
    return runs


def resolve_rest(engine: StepHost, sampling: list[Request], accepted: list[list[int]],
                 outputs: StepBatch) -> None:
    """Each sampling row's accepted tokens after its first (``accepted[i][1:]``; a row
    finished by its first token takes none) into its request and ``outputs``."""
    runs = _runs(engine, sampling, accepted)
    if not runs:
        return
    stream_of = engine.streams.by_request
    engine.tokens_generated += sum(len(run[1]) for run in runs)
    if len(runs) == 1:  # one row (batch 1): its tokens as whole lists
        request, tokens = runs[0][0], runs[0][1]
        outputs.streams += [stream_of[request.request_id]] * len(tokens)
        outputs.token_ids += tokens
        if outputs.logprobs is not None:
            outputs.logprobs += [None] * len(tokens)
        _end(engine, outputs, runs[0], len(outputs.streams) - 1)
        return
    for position in range(max(len(run[1]) for run in runs)):
        for run in runs:
            if position < len(run[1]):
                row = outputs.add_row(stream_of[run[0].request_id], run[1][position], None)
                if position == len(run[1]) - 1:
                    _end(engine, outputs, run, row)


def _end(engine: StepHost, outputs: StepBatch, run: Run, row: int) -> None:
    """A run whose last token finishes its request: finish it, its end at ``row``."""
    request, _, reason, error = run
    if reason is not None:
        engine.scheduler.finish(request, reason, error=error)
        outputs.ends.append(engine.engine_end(request, row))
