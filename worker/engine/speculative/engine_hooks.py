"""Speculative decoding inside the engine's step: draft, verify, accept.

Before scheduling, each eligible running decode row gets a draft from the suffix proposer
(``Scheduler.drafts``); the scheduler gives it 1 + k tokens of the step (its last known
token and the k drafts) through the ordinary ragged path, blocks included. One forward
returns logits for all 1 + k positions; position j is sampled with the key of output
index n + j (``SamplingRow.output_index``: greedy is argmax, a seeded row draws the noise
it would draw without speculation). Drafts are accepted while ``draft_j == sampled_j``,
then the first sampled token that differs (or the bonus token after all k) is appended:
1..k+1 tokens per row per step, each one the token the row would have produced without
speculation. Each row's first token goes through the scheduler's own decode path with the
rest of the batch (``advance`` + ``Engine.apply_tokens``); the accepted tokens after it
in one pass per row (``resolve.py``: the same stop checks, EOS, stop ids, ``min_tokens``,
``max_tokens``, the context, cutting the run at its first finishing token), so counters,
outputs and the prefix cache see exactly the steps a plain decode would have made; a token
after a stop is never produced. Drafts never enter a request's
token list, so no block hash (and no registered block) ever covers a draft.

A row with a grammar drafts too: its draft is cut at the first token the grammar rejects,
and position j of the row samples under the mask of the state after the drafts before it
(``StructuredOutputs.start_bitmask``), so each is exactly the plain step's mask whenever
the drafts before it are accepted; the matcher advances over the accepted tokens only.

Tenants: a request drafts from its own text and its own tenant's stored texts only (the
tenant read off its scoped id, ``protocol.tenants.ids``, which the protocol checks against the
request's ``tenant``); what it stores on finishing is filed under that tenant, here and
in the fleet's stream, and the back-off's estimates are per tenant too.

Only with overlap off (the tokens must be known to draft from them): ``Engine`` turns
overlap off when speculation is asked for and ``async_scheduling`` is left unset, and turns
speculation off (logged) when both are asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch

from protocol.tenants.ids import tenant_of_id
from worker.engine.output.step_batch import StepBatch
from worker.engine.request import FinishReason, Request
from worker.engine.sample.sampler import SamplingRow
from worker.engine.sched.schedule_output import ScheduledRequest, SchedulerOutput
from worker.engine.speculative.backoff import AcceptanceModel
from worker.engine.speculative.config import SpeculativeConfig
from worker.engine.speculative.draft_store import DraftStore
from worker.engine.speculative.resolve import resolve_rest
from worker.engine.speculative.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from worker.engine.speculative.host import StepHost

_log = structlog.get_logger("ferry.worker.spec")


def tenant_of(request: Request) -> str:
    """The tenant a request's drafts and stored text belong to (its scoped id's; an
    ``n > 1`` candidate's id extends its parent's, so it is the same)."""
    return tenant_of_id(request.request_id)


def eligible(request: Request) -> bool:
    """Whether a running row may carry drafts: a plain decode (its last token known and not
    computed) whose logits do not depend on its output history or on state the sampler
    keeps, and that reports no per-token logprobs. A grammar is no obstacle: drafts are
    cut to what it accepts and each position gets its state's mask."""
    p = request.params
    return (request.num_pending == 0
            and request.num_computed_tokens == request.num_tokens - 1
            and not request.bans_follow_output
            and not request.penalised and p.logprobs is None
            and request.prompt_logprobs is None and request.parent_id is None
            and request.lora is None)


class SpecDecoding:
    """The engine's speculative decoding: the proposer, its counters, the verifying step."""

    def __init__(self, config: SpeculativeConfig, engine: StepHost) -> None:
        self.config = config
        self.engine = engine
        self.proposer = SuffixProposer(config)
        # tokens each request's drafter has observed, and the request's tenant
        self._seen: dict[str, tuple[int, str]] = {}
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.draft_rows = 0  # row-steps that carried drafts
        self.store_rows = 0  # ... of which drafted from the store (past outputs)
        self.grammar_cut_tokens = 0  # draft tokens dropped: a grammar rejected them
        self._from_store: set[str] = set()  # this step's rows drafted from the store
        # The back-off's estimates, and this step's drafts' (tenant, source, match length)
        self.acceptance = AcceptanceModel(config.costs)
        self._matches: dict[str, tuple[str, str, int]] = {}
        self.backoff_cut_tokens = 0  # draft tokens the back-off dropped (not worth verifying)
        # Called with each text stored and its tenant (the service shares it with the
        # fleet)
        self.on_stored: Callable[[list[int], str], None] | None = None

    @property
    def store(self) -> DraftStore:
        """The store of past outputs (the fleet's feed adds to it between steps)."""
        return self.proposer.store

    @classmethod
    def create(cls, config: SpeculativeConfig, engine: StepHost) -> SpecDecoding | None:
        if not config.enabled:
            return None
        if engine.overlap:
            _log.warning("speculative_decoding_off", reason="async_scheduling is on: "
                         "drafts need the previous step's tokens; set async_scheduling "
                         "off (or leave it unset) to speculate")
            return None
        return cls(config, engine)

    # -- before scheduling ---------------------------------------------------------------
    def propose(self) -> None:
        """Drafts for the running rows into ``scheduler.drafts``, each cut to what the
        back-off finds worth verifying at this batch size (none for a batch larger than
        ``max_batch_rows``, nor while a request waits for prompt logprobs)."""
        engine = self.engine
        scheduler = engine.scheduler
        rows = len(scheduler.running)
        if rows > self.config.max_batch_rows or engine.scoring.pending:
            return
        drafts: dict[str, list[int]] = {}
        self._from_store.clear()
        self._matches.clear()
        self.proposer.store.expire()  # nothing past the TTL is offered
        for request in scheduler.running:
            if not eligible(request):
                continue
            limit = min(request.params.max_tokens - request.num_output_tokens,
                        engine.max_model_len - request.num_tokens) - 1
            if limit <= 0:
                continue
            tenant = self._observe(request)
            draft = self.proposer.propose(request.request_id, limit)
            worth = self.acceptance.draft_length(request.request_id, tenant, draft.source,
                                                 draft.match_length, len(draft.tokens), rows)
            self.backoff_cut_tokens += len(draft.tokens) - worth
            tokens = draft.tokens[:worth]
            valid = engine.structured.valid_draft(request, tokens)  # [structured output]
            self.grammar_cut_tokens += len(tokens) - valid
            if valid:
                drafts[request.request_id] = tokens[:valid]
                self._matches[request.request_id] = (tenant, draft.source,
                                                     draft.match_length)
                if draft.source == "store":
                    self._from_store.add(request.request_id)
        scheduler.drafts = drafts

    def _observe(self, request: Request) -> str:
        """Feed the request's new tokens to its drafter; returns its tenant."""
        rid, tokens = request.request_id, request.all_token_ids
        seen = self._seen.get(rid)
        if seen is None or rid not in self.proposer:
            tenant = tenant_of(request)
            self.proposer.start(rid, list(tokens), tenant)
        else:
            count, tenant = seen
            if count < len(tokens):
                self.proposer.observe(rid, tokens[count:])
        self._seen[rid] = (len(tokens), tenant)
        return tenant

    def counters(self) -> dict[str, int]:
        """Its ``EngineStats`` fields (``spec_*``)."""
        return {"spec_drafted_tokens": self.drafted_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_draft_rows": self.draft_rows,
                "spec_store_rows": self.store_rows,
                "spec_grammar_cut_tokens": self.grammar_cut_tokens,
                "spec_backoff_cut_tokens": self.backoff_cut_tokens}

    def finished(self, request: Request) -> None:
        """A request ended: drop its drafter; a completed output goes into its tenant's
        store (and to ``on_stored``: a hook that must not block, it runs on the engine
        thread), unless the store keeps nothing (``store_tokens`` or ``store_ttl_s`` 0).
        An adapter's output is not stored: the store drafts for the base model's rows
        (LoRA rows never draft), and the fleet's stream is the base model's."""
        self._seen.pop(request.request_id, None)
        self.proposer.forget(request.request_id)
        self.acceptance.forget(request.request_id)
        if request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) \
                and request.output_token_ids and request.lora is None \
                and self.config.keeps_outputs:
            tail = self.config.stored_prompt_tail
            prompt = request.prompt_token_ids[-tail:] if tail else []
            text = prompt + request.output_token_ids
            tenant = tenant_of(request)
            self.proposer.store.add(text, tenant)
            if self.on_stored is not None:
                self.on_stored(text, tenant)

    # -- the step ----------------------------------------------------------------------
    def run(self, sched: SchedulerOutput, outputs: StepBatch) -> None:
        """Forward, sample every position, verify, and resolve the accepted tokens."""
        engine = self.engine
        sampling = sched.sampling
        n = len(sampling)
        rows = [SamplingRow.of(r) for r in sampling]
        flat, extra = self._draft_rows(sched, rows)
        mask = engine.structured.start_bitmask(sampling, sched.drafts)  # per position
        plan = engine.scoring.plan(sched) if engine.scoring.pending else None  # rows
        # before the drafts'
        prompt_rows = plan.rows if plan is not None else []
        start = perf_counter()
        logits = engine.runner.execute(sched, engine.block_manager, None, prompt_rows + flat)
        engine.phase_s["forward"] += perf_counter() - start
        drafts_logits = logits[n + len(prompt_rows):]
        logits = logits[:n + len(prompt_rows)]
        prompt = None
        if plan is not None:
            logits, prompt = engine.scoring.collect(plan, logits, n)
        start = perf_counter()
        result = engine.sampler.launch(torch.cat([logits, drafts_logits]), rows + extra,
                                       mask.get()).result()
        engine.phase_s["sample"] += perf_counter() - start
        if prompt is not None:
            engine.scoring.finish(prompt)
        accepted = self._verify(sched, result.token_ids, n)
        first = [seq[0] for seq in accepted]
        plain = SchedulerOutput([ScheduledRequest(s.request, 1, True)
                                 if s.request.request_id in sched.drafts else s
                                 for s in sched.scheduled])
        plain.num_batched_tokens = sum(s.num_new_tokens for s in plain.scheduled)
        engine.scheduler.advance(plain)
        engine.apply_tokens(outputs, plain, first, result.logprobs[:n])
        resolve_rest(engine, sampling, accepted, outputs)  # the tokens after each first

    def _draft_rows(self, sched: SchedulerOutput, rows: list[SamplingRow]
                    ) -> tuple[list[int], list[SamplingRow]]:
        """The flat positions of the drafts (the logits kept after the sampling rows') and
        their sampling rows: position j of a row samples its output index n + j."""
        flat: list[int] = []
        extra: list[SamplingRow] = []
        ends = np.cumsum([s.num_new_tokens for s in sched.scheduled]).tolist()
        index = 0
        for item, end in zip(sched.scheduled, ends, strict=True):
            if not item.sample:
                continue
            draft = sched.drafts.get(item.request.request_id)
            if draft:
                k, base = len(draft), rows[index].output_index
                rows[index].output_index = base + k  # the last position: the bonus token
                flat.extend(range(end - 1 - k, end - 1))
                extra.extend(replace(rows[index], output_index=base + j) for j in range(k))
            index += 1
        return flat, extra

    def _verify(self, sched: SchedulerOutput, tokens: list[int], n: int) -> list[list[int]]:
        """Per sampling row, the tokens it gets: the accepted drafts and one sampled token."""
        out: list[list[int]] = []
        offset = n
        for i, request in enumerate(sched.sampling):
            draft = sched.drafts.get(request.request_id)
            if not draft:
                out.append([tokens[i]])
                continue
            k = len(draft)
            sampled = tokens[offset:offset + k] + [tokens[i]]
            offset += k
            a = 0
            while a < k and draft[a] == sampled[a]:
                a += 1
            self.drafted_tokens += k
            self.accepted_tokens += a
            self.draft_rows += 1
            self.store_rows += request.request_id in self._from_store
            tenant, source, length = self._matches[request.request_id]
            self.acceptance.record(request.request_id, tenant, source, length, k, a)
            out.append(sampled[:a + 1])
        return out
