"""The engine: add requests (``request_adds.py``), step, end them (``request_ends.py``) —
no I/O inside a step.

``step()`` is schedule -> execute -> sample -> update. The service drives it from one
thread; anything arriving from other threads (new requests, cancels) is handed over
between steps. With ``async_scheduling`` (on for CUDA) a step is launched before the
previous one is read back, and ``step()`` returns the previous step's tokens
(``inflight.py``). A step returns token ids, nothing else (``step_batch.py``): text and
stop strings are the output side's (``text_output.py``, the worker's output process),
which ends a request on a stop string with ``finish_stream``.
"""

from __future__ import annotations

from collections import defaultdict
from time import perf_counter
from typing import Any

from worker.engine.choices import CandidateGroups
from worker.engine.config import EngineConfig
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.engine_stats import EngineStats
from worker.engine.health import raise_if_device_fault
from worker.engine.inflight import InflightStep
from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
from worker.engine.kv.block_manager import BlockManager
from worker.engine.kv.host_tier import HostTier, host_tier_bytes
from worker.engine.lora.engine_hooks import enable_lora
from worker.engine.output.step_batch import EngineEnd, StepBatch, StreamRegistry
from worker.engine.request import FinishReason, Request
from worker.engine.request_adds import RequestAdds
from worker.engine.request_ends import RequestEnds
from worker.engine.runner.model_runner import ModelRunner
from worker.engine.runner.tp_follower import start_ranks
from worker.engine.runner.warmup import warm_up_sampling
from worker.engine.sample.prompt_logprobs import PromptScoring, take
from worker.engine.sample.rows import ONE_BY_ONE, SamplerColumns
from worker.engine.sample.sampler import Sampler, SamplingRow
from worker.engine.sched.scheduler import Scheduler, SchedulerOutput
from worker.engine.speculative.engine_hooks import SpecDecoding
from worker.engine.structured.decoding import StructuredOutputs

_GRAMMAR_WAIT_S = 0.005  # idle loop: how long to wait for a pending grammar compile


class Engine(RequestAdds, RequestEnds):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ranks = start_ranks(config)  # None: one process (tensor_parallel_size 1)
        try:
            self.runner = ModelRunner(config.model, config.cache,
                                      config.scheduler.max_num_seqs, config.lora,
                                      lead=self.ranks,
                                      tp=TPConfig(config.tensor_parallel_size, 0))
        except Exception as exc:
            if self.ranks is not None:  # the followers wait on a group rank 0 will not lead
                raise self.ranks.fault(f"rank 0 failed to load: {exc}") from exc
            raise
        self.tokenizer = self.runner.loaded.tokenizer
        self.max_model_len = self.runner.shape.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.watermark,
            enable_caching=config.cache.enable_prefix_caching,
            salt=f"{config.model.model}|{self.runner.loaded.dtype}|{self.runner.kv_dtype}",
        )
        # the worker's whole tier: each rank holds the same slots of its heads' share
        tier_bytes = host_tier_bytes(config.cache.host_memory_bytes,
                                     self.runner.device) // config.tensor_parallel_size
        self.block_manager.attach_tier(HostTier.for_pool(self.runner.kv_pool, tier_bytes))
        self.columns = SamplerColumns()  # the sampler's constants, by the batch's rows
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   columns=(self.columns,))
        self.lora = enable_lora(self.runner, self.scheduler, config)  # None: LoRA off
        self.prompts = PromptBuilder(self.tokenizer, PromptLimits(
            vocab_size=self.runner.shape.vocab_size, max_model_len=self.max_model_len,
            num_blocks=self.block_manager.num_blocks, block_size=config.cache.block_size,
        ))
        self.sampler = Sampler(config.seed)
        warm_up_sampling(self.runner, self.sampler)  # CUDA: the fused pass, or its twin
        # wall seconds per step phase (schedule, forward, sample, update), summed over the
        # steps: profiles and benchmarks read it (``clear()`` starts over)
        self.phase_s: defaultdict[str, float] = defaultdict(float)
        self.structured = StructuredOutputs(  # [structured output]
            self.tokenizer, self.runner.shape.vocab_size, self.runner.loaded.eos_token_ids)
        self.streams = StreamRegistry()  # request <-> the small int its rows carry
        self._groups = CandidateGroups()  # n > 1: the candidates an abort must reach
        self.scoring = PromptScoring()  # requests still missing prompt logprobs
        overlap = config.scheduler.async_scheduling
        if overlap is None:  # speculation needs known tokens: it wins over the default
            overlap = (self.runner.device.type == "cuda" and not config.speculative.enabled
                       and self.ranks is None)
        self.overlap = overlap
        self.spec = SpecDecoding.create(config.speculative, self)  # None: off
        self._inflight: InflightStep | None = None  # launched, not read back
        self.tokens_generated = 0
        self.steps = 0

    # -- tensor-parallel ranks -----------------------------------------------------------
    def check_ranks(self) -> None:
        """Raise ``TensorParallelFault`` (a ``DeviceFault``: the worker ends) if a rank of
        this worker's tensor-parallel group has exited; a no-op in one process."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """End the tensor-parallel followers and leave their group (one process: no-op)."""
        if self.ranks is not None:
            self.ranks.close()

    # -- stepping ----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> StepBatch:
        """Schedule and launch a step; return the tokens of the step read back (this one,
        or with overlap the one launched before it) and the requests that ended."""
        outputs = StepBatch(ends=self._grammar_failures())  # [structured output]
        start = perf_counter()
        if self.spec is not None:
            self.spec.propose()  # drafts: the scheduler gives them their tokens
        sched = self.scheduler.schedule()
        outputs.cached = self.streams.cached_of(self.scheduler.take_first_scheduled())
        self.phase_s["schedule"] += perf_counter() - start
        if not sched.is_empty:
            self._run(sched, outputs)
        elif self._inflight is not None:
            self._read_back(outputs)
        elif outputs.is_empty and self.structured.pending:
            self.structured.wait(_GRAMMAR_WAIT_S)  # [structured output] nothing else to do
        outputs.opened = self.streams.take_opened()
        return outputs

    def _run(self, sched: SchedulerOutput, outputs: StepBatch) -> None:
        """Run a scheduled step into ``outputs``: a verifying step at once, a plain one
        launched (the step before read back first), and read back at once without
        overlap. A failed forward fails its batch, not the worker, unless the device
        itself is gone."""
        self.steps += 1
        try:
            if sched.drafts:  # a verifying step: synchronous (overlap is off)
                assert self.spec is not None
                self.spec.run(sched, outputs)
                return
            launched = self._launch(sched, outputs)
        except Exception as exc:
            raise_if_device_fault(exc)
            self._read_back(outputs)
            outputs.extend_ends(self._fail_batch(sched, exc))
            return
        self._read_back(outputs)  # the step launched before, if any
        self._inflight = launched
        if not self.overlap:
            self._read_back(outputs)

    def _launch(self, sched: SchedulerOutput, outputs: StepBatch) -> InflightStep:
        """Forward and sample without waiting for the device; placeholders for the tokens.

        Overlap is never switched off (``inflight.py``): penalties count the token in
        flight on the device, prompt logprobs come back with the step's tokens, and a step
        whose masks need the previous step's tokens on the host (a grammar) reads that step
        back, into ``outputs``, only once its own forward is launched."""
        sampling = sched.sampling
        prev = self._inflight
        rows = SamplingRow.rows_of(sampling, prev)
        at = sched.sampling_rows()  # their constants as arrays (before ``advance``)
        constants = None if at is None \
            else self.columns.take(at, self.scheduler.batch.tokens[at])
        constrained = sched.needs_known_tokens()  # a grammar or a multi-token bad word
        known = prev is not None and constrained
        # the masks overlap the forward; no row constrained: none to make
        mask = self.structured.start_bitmask(sampling) if constrained and not known else None
        # prompt logprobs: only while a request still waits for them
        extra = self.scoring.plan(sched) if self.scoring.pending else None
        start = perf_counter()
        logits = self.runner.execute(sched, self.block_manager, prev,
                                     extra.rows if extra is not None else None)
        self.phase_s["forward"] += perf_counter() - start
        prompt = None
        if extra is not None:
            logits, prompt = self.scoring.collect(extra, logits, len(sampling))
        if known:  # the forward runs meanwhile; then the masks from the known tokens
            self.scheduler.advance(sched)
            self._read_back(outputs)  # the step before (``known`` implies one)
            for row, request in zip(rows, sampling, strict=True):
                row.refresh(request)
            mask = self.structured.start_bitmask(sampling)  # [structured output]
        start = perf_counter()
        sample = self.sampler.launch(logits, rows, mask.get() if mask is not None else None,
                                     constants)
        self.phase_s["sample"] += perf_counter() - start
        if not known and self.overlap:  # after sampling: rows may hold the token lists
            self.scheduler.advance(sched)  # (no overlap: with its tokens, advance_resolve)
        return InflightStep(sched, sample, None, prompt, known or self.overlap,
                            constants)

    def _read_back(self, batch: StepBatch) -> None:
        """Wait for the launched step's tokens (none launched: nothing to do), then the
        finish checks; its rows into ``batch``."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        start = perf_counter()
        try:
            result = step.sample.result()
            if step.prompt is not None:
                self.scoring.finish(step.prompt)
        except Exception as exc:  # an asynchronous device error surfaces here
            raise_if_device_fault(exc)
            batch.extend_ends(self._fail_batch(step.sched, exc))
        else:
            self.apply_tokens(batch, step.sched, result.token_ids, result.logprobs, step)
        self.phase_s["update"] += perf_counter() - start

    def _grammar_failures(self) -> list[EngineEnd]:
        """[structured output] Finish requests whose grammar failed to compile: their fault."""
        if not self.structured.pending:  # no grammar compiling: nothing to look at
            return []
        ends = []
        for request in self.structured.poll():
            self.scheduler.finish(request, FinishReason.ERROR, error=request.grammar.error)
            ends.append(self.engine_end(request, error_kind="invalid_request"))
        return ends

    def apply_tokens(self, batch: StepBatch, sched: SchedulerOutput, tokens: list[int],
                     logprobs: list[Any], step: InflightStep | None = None) -> None:
        """A step's sampled tokens into its requests (finish checks over arrays) and
        ``batch``. ``step``: the launched step (it may advance with them, and knows its
        rows' flags); None: ``sched`` has advanced already (a verified speculative step).

        Rows with no logprobs, grammar or prompt logprobs (most of a large batch) go in
        as whole lists; the others one at a time, in row order either way."""
        got = self.scheduler.resolve_sampled(sched, tokens) if step is None or step.advanced \
            else self.scheduler.advance_resolve(sched, tokens)
        requests = got.requests
        self.tokens_generated += len(requests)
        if step is not None and step.constants is not None:  # the rows' flags of the launch
            one_by_one = step.constants.any(ONE_BY_ONE)
        else:
            one_by_one = any(r.grammar is not None or r.prompt_logprobs is not None
                             for r in (step.sched.sampling if step is not None else requests))
        if not one_by_one and not any(logprobs):
            stream_of = self.streams.by_request
            first = len(batch.streams)
            batch.streams += [stream_of[r.request_id] for r in requests]
            batch.token_ids += got.tokens
            if batch.logprobs is not None:
                batch.logprobs += [None] * len(requests)
            for i in got.ended:  # in row order
                batch.ends.append(self.engine_end(requests[i], first + i))
            return
        for i, request, token in zip(got.index.tolist(), requests, got.tokens, strict=True):
            self._update_row(batch, request, token, logprobs[i])

    def _update_row(self, batch: StepBatch, request: Request, token: int, lp: Any) -> None:
        grammar_end = self.structured.advance(request)  # [structured output]
        if grammar_end is not None:
            self.scheduler.finish(request, grammar_end[0], error=grammar_end[1])
        if lp is not None:
            request.cumulative_logprob += lp[0]
            lp = lp if request.report_logprobs else None
        stream = self.streams.by_request[request.request_id]
        row = batch.add_row(stream, token, lp)
        if request.is_finished:
            batch.ends.append(self.engine_end(request, row))
        elif request.prompt_logprobs is not None:
            first = take(request)
            if first is not None:
                batch.prompt_logprobs[stream] = first

    # -- the prefix cache's keys, for prefix affinity -------------------------------------
    def track_evictions(self) -> None:
        """From now on, list the hashes of the blocks that leave the prefix cache for good
        (``kv/block_evictions.py``), for ``drain_evicted``."""
        self.block_manager.track_evictions()

    def drain_evicted(self) -> list[bytes]:
        """The hashes gone for good since the last call (tracked): a test of one attribute
        when nothing was evicted."""
        return self.block_manager.drain_evicted() if self.block_manager.evicted else []

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of the request's first ``num_blocks`` full blocks."""
        return self.block_manager.block_hashes(request, num_blocks)

    def stats(self) -> EngineStats:
        """The engine's counters now, read off its parts (the service stores one after
        every loop iteration for its heartbeats and metrics)."""
        sched, bm, health = self.scheduler, self.block_manager, self.runner.health
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
            num_preemptions=sched.num_preemptions, tokens_generated=self.tokens_generated,
            steps=self.steps, prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits, kv_blocks_cached=bm.num_cached_blocks,
            **(bm.tier.counters() if bm.tier is not None else {}),
            **(self.spec.counters() if self.spec is not None else {}),
            degraded=tuple(sorted(health.reasons)),
            decode_graphs_active=health.decode_graphs_active,
        )
