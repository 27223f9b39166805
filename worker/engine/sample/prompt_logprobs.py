"""Prompt logprobs: each prompt token's logprob given the tokens before it (vLLM's
``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``, which lm-evaluation-harness
scores log-likelihoods with).

The model runner computes logits only for rows that sample; a request asking for prompt
logprobs also needs the rows of its prompt positions. Per step, ``plan`` lists those
rows (position ``p``'s logits give the logprob of token ``p + 1``) for the requests that
ask, and only the positions they still miss, so a chunked prefill fills the record chunk
by chunk and a recompute after preemption adds nothing twice. ``collect`` turns the
extra logits into each request's record. A request still missing prompt logprobs takes no
cached prefix blocks (the scheduler checks ``Request.needs_prompt_logits``), so a
prefix-cache hit still computes the positions it must report — vLLM does the same.

Nothing here runs unless a request asks: ``plan`` returns None at once otherwise. When one
does, ``collect`` computes the logprobs and top-k on the device and starts their copy
back; ``finish`` records them when the step's tokens are read back (before its outputs),
so a step with prompt logprobs is overlapped like any other. An entry is recorded only
at its place (position ``p`` is entry ``p + 1``): a recompute launched before the first
computation was read back adds nothing twice. The logits of one step's extra rows are
[rows, vocab] floats: the step's token budget bounds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.request import Request
from worker.engine.runner.transfer import ReadBack, to_device
from worker.engine.sched.schedule_output import SchedulerOutput

PromptEntry = tuple[int, float | None, list[tuple[int, float]]]
"""(token id, its logprob or None for the first token, [(token id, logprob), ...top-k])."""


@dataclass
class PromptPlan:
    """The extra logits rows of one step: flat row indices, the token each row scores,
    and whose record each row extends (in row order)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[Request] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # the prompt position each scores


@dataclass(eq=False)
class PendingPrompt:
    """A step's prompt logprobs, computed on the device and on their way back: per row
    the target's logprob, then the top-k logprobs, then their ids ([R, 1 + 2k] float64)."""

    plan: PromptPlan
    packed: ReadBack


class PromptScoring:
    """The engine's requests still missing prompt logprobs, and their per-step rows."""

    def __init__(self) -> None:
        self.pending: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        """Give a request that asks its record (the first token has no logprob)."""
        if request.params.prompt_logprobs is not None and request.num_prompt_tokens:
            request.prompt_logprobs = [(request.prompt_token_ids[0], None, [])]
            if request.needs_prompt_logits:
                self.pending[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def plan(self, sched: SchedulerOutput) -> PromptPlan | None:
        """Rows to keep this step (None: none of its rows needs them). The engine calls it
        only while ``pending`` holds a request."""
        return plan(sched)

    def collect(self, prompt_plan: PromptPlan, logits: torch.Tensor,
                num_sampling: int) -> tuple[torch.Tensor, PendingPrompt]:
        """Start the prompt rows' logprobs (they follow the sampling rows) without waiting
        for them; returns the sampling logits and what ``finish`` records later."""
        return logits[:num_sampling], collect(prompt_plan, logits[num_sampling:])

    def finish(self, pending: PendingPrompt) -> None:
        """Record a step's prompt logprobs (read back with its tokens)."""
        record(pending)
        self.pending = {k: r for k, r in self.pending.items() if r.needs_prompt_logits}


def take(request: Request) -> list[PromptEntry] | None:
    """The request's prompt logprobs, once, when complete (with its first output)."""
    if request.prompt_logprobs is None or request.prompt_logprobs_sent \
            or request.needs_prompt_logits:
        return None
    request.prompt_logprobs_sent = True
    return request.prompt_logprobs  # type: ignore[no-any-return]


def plan(sched: SchedulerOutput) -> PromptPlan | None:
    """The extra rows of one step: the prompt positions its requests still miss."""
    out = PromptPlan()
    offset = 0
    for item in sched.scheduled:
        request = item.request
        if request.needs_prompt_logits:
            lo = request.num_computed_tokens
            record = request.prompt_logprobs or []
            first = max(lo, len(record) - 1)  # positions already scored are skipped
            last = min(lo + item.num_new_tokens, request.num_prompt_tokens - 1)
            for position in range(first, last):
                out.rows.append(offset + position - lo)
                out.targets.append(request.prompt_token_ids[position + 1])
                out.owners.append(request)
                out.positions.append(position)
        offset += item.num_new_tokens
    return out if out.rows else None


def collect(prompt_plan: PromptPlan, logits: torch.Tensor) -> PendingPrompt:
    """The rows' logprobs on the device, their copy back started. logits: [rows, vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    targets = to_device(prompt_plan.targets, torch.long, logprobs.device)  # [R]
    chosen = logprobs.gather(1, targets[:, None]).double()  # [R, 1]
    k = min(max(r.params.prompt_logprobs or 0 for r in prompt_plan.owners), logprobs.shape[1])
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)  # [R, k]
        chosen = torch.cat([chosen, values.double(), ids.double()], dim=1)  # [R, 1 + 2k]
    return PendingPrompt(prompt_plan, ReadBack(chosen))


def record(pending: PendingPrompt) -> None:
    """Append each row's entry to its request's record, where it belongs."""
    table = pending.packed.wait().tolist()
    prompt_plan = pending.plan
    for line, request, target, position in zip(table, prompt_plan.owners, prompt_plan.targets,
                                               prompt_plan.positions, strict=True):
        entries = request.prompt_logprobs
        if entries is None or len(entries) != position + 1:
            continue  # scored already (a recompute), or the request was dropped
        n = request.params.prompt_logprobs or 0
        k = (len(line) - 1) // 2
        top = [(int(line[1 + k + j]), line[1 + j]) for j in range(min(n, k))]
        entries.append((target, line[0], top))
