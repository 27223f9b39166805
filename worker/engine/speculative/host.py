"""``StepHost``: what speculative decoding reads and calls of the engine.

The verifying step (``engine_hooks.SpecDecoding.run``) and the accepted tokens after each
row's first (``resolve.py``) drive the engine's own parts: its scheduler, runner, sampler,
grammars and prompt scoring, its token application and its request ends. Typed by this
Protocol rather than by ``Engine``, which imports the speculative package; the imports
below are for the type checker only, so this module costs nothing at run time.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from worker.engine.inflight import InflightStep
    from worker.engine.kv.block_manager import BlockManager
    from worker.engine.output.step_batch import EngineEnd, StepBatch, StreamRegistry
    from worker.engine.request import Request
    from worker.engine.runner.model_runner import ModelRunner
    from worker.engine.sample.prompt_logprobs import PromptScoring
    from worker.engine.sample.sampler import Sampler
    from worker.engine.sched.scheduler import Scheduler, SchedulerOutput
    from worker.engine.structured.decoding import StructuredOutputs


class StepHost(Protocol):
    """The engine as speculative decoding sees it (``Engine`` is one)."""

    scheduler: Scheduler
    block_manager: BlockManager
    runner: ModelRunner
    sampler: Sampler
    structured: StructuredOutputs
    scoring: PromptScoring
    streams: StreamRegistry
    phase_s: defaultdict[str, float]
    max_model_len: int
    overlap: bool
    tokens_generated: int

    def apply_tokens(self, batch: StepBatch, sched: SchedulerOutput, tokens: list[int],
                     logprobs: list[Any], step: InflightStep | None = None) -> None: ...

    def engine_end(self, request: Request, row: int = -1,
                   error_kind: str | None = None) -> EngineEnd: ...
