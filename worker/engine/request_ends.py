"""How the engine ends requests outside a normal step's stop checks: aborts, a stop string
found by the output side, a failed batch, and the ``EngineEnd`` every ending produces.

A mixin of ``Engine`` (it reads the engine's scheduler, streams, candidate groups, prompt
scoring and speculative state), apart from the step loop so that each reads on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.engine.output.step_batch import EngineEnd
from worker.engine.request import FinishReason, Request
from worker.engine.sample.prompt_logprobs import take

if TYPE_CHECKING:
    from worker.engine.choices import CandidateGroups
    from worker.engine.kv.block_manager import BlockManager
    from worker.engine.output.step_batch import StreamRegistry
    from worker.engine.sample.prompt_logprobs import PromptScoring
    from worker.engine.sched.scheduler import Scheduler, SchedulerOutput
    from worker.engine.speculative.engine_hooks import SpecDecoding


class RequestEnds:
    scheduler: Scheduler
    block_manager: BlockManager
    streams: StreamRegistry
    scoring: PromptScoring
    spec: SpecDecoding | None
    _groups: CandidateGroups

    def abort(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> list[EngineEnd]:
        """Drop a waiting or running request (every candidate of it) now; returns the end
        of each one still unfinished (none if unknown)."""
        ids = self._groups.take(request_id)
        ends = []
        for rid in ids:
            request = self.scheduler.requests.get(rid)
            if request is not None:
                self.scheduler.finish(request, reason)
                ends.append(self.engine_end(request))
        return ends

    def finish_stream(
        self, stream: int, reason: str = "stop", stop_reason: str | int | None = None
    ) -> EngineEnd | None:
        """The output side ended a stream (a stop string): finish its request now. With the
        output in another process this lands a step late; the token sampled meanwhile is
        dropped there. Returns the end (None if the request had already ended)."""
        request = self.streams.requests.get(stream)
        if request is None or request.is_finished:
            return None
        request.stop_reason = stop_reason
        self.scheduler.finish(request, FinishReason(reason))
        return self.engine_end(request)

    def engine_end(self, request: Request, row: int = -1,
                   error_kind: str | None = None) -> EngineEnd:
        """The ``EngineEnd`` of a request just finished (its stream closed, its
        drafter, candidate group and prompt scoring told); ``row``: its last token's row in
        the step's batch (-1: none)."""
        stream = self.streams.close(request)
        if self.spec is not None:
            self.spec.finished(request)
        if request.parent_id is not None:
            self._groups.finished(request.public_id, request.request_id)
        self.scoring.forget(request.request_id)
        ranked = request.parent_id is not None and request.params.logprobs is not None
        return EngineEnd(
            stream, str(request.finish_reason), request.stop_reason, request.error,
            request.num_prompt_tokens, request.num_output_tokens, row, error_kind,
            request.cumulative_logprob if ranked else None, take(request),
        )

    def _fail_batch(self, sched: SchedulerOutput, exc: Exception) -> list[EngineEnd]:
        message = f"{type(exc).__name__}: {exc}"
        self.block_manager.forget_step()  # what this step registered was never computed
        ends = []
        for item in sched.scheduled:
            if not item.request.is_finished:
                self.scheduler.finish(item.request, FinishReason.ERROR, error=message)
                ends.append(self.engine_end(item.request))
        return ends
