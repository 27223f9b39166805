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
does, its steps read the extra logits back at launch (a host sync), which only such steps
pay. The logits of one step's extra rows are [rows, vocab] floats: the step's token
budget bounds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.request import Request
from worker.engine.scheduler import SchedulerOutput

PromptEntry = tuple[int, float | None, list[tuple[int, float]]]
"""(token id, its logprob or None for the first token, [(token id, logprob), ...top-k])."""


@dataclass
class PromptPlan:
    """The extra logits rows of one step: flat row indices, the token each row scores,
    and whose record each row extends (in row order)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[Request] = field(default_factory=list)


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
        """Rows to keep this step; None at once when no request asks."""
        return plan(sched) if self.pending else None

    def collect(self, prompt_plan: PromptPlan, logits: torch.Tensor,
                num_sampling: int) -> torch.Tensor:
        """Record the prompt rows (they follow the sampling rows); the sampling logits."""
        collect(prompt_plan, logits[num_sampling:])
        self.pending = {k: r for k, r in self.pending.items() if r.needs_prompt_logits}
        return logits[:num_sampling]


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
        offset += item.num_new_tokens
    return out if out.rows else None


def collect(prompt_plan: PromptPlan, logits: torch.Tensor) -> None:
    """Append each row's entry to its request's record. logits: [rows, vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    targets = torch.tensor(prompt_plan.targets, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()  # [R]
    k = max(r.params.prompt_logprobs or 0 for r in prompt_plan.owners)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)  # [R, k]
        top_values, top_ids = values.tolist(), ids.tolist()
    for i, (request, target) in enumerate(zip(prompt_plan.owners, prompt_plan.targets,
                                              strict=True)):
        n = request.params.prompt_logprobs or 0
        top = list(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else []
        assert request.prompt_logprobs is not None
        request.prompt_logprobs.append((target, chosen[i], top))
