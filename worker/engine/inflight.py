"""Overlapped steps: step N+1 is scheduled and launched before step N is read back.

On a GPU the host's share of a step (scheduling, building inputs, detokenizing, stop
checks) would otherwise leave the device idle between steps. With ``async_scheduling``
the engine launches a step and returns to the host work while it runs: the scheduler
counts each sampling row's token at launch (a placeholder, ``request.py``), the next
step is scheduled from those counts, and a decode whose input is a placeholder reads it
from the previous step's sampled tokens on the device (``ModelRunner`` patches them in),
so no step waits for the previous one's read-back. A request that ends at step N (EOS,
stop string, cancel) may already be in step N+1: that token is computed and dropped.

Overlap is never switched off. A penalised row counts its token of the step in flight on
the device (``SamplingRow.pending_output``), and prompt logprobs are computed on the device
and read back with the step's tokens (``prompt_logprobs.py``). A step whose sampling needs
earlier tokens' values on the host (a grammar's mask, a multi-token bad word) still
launches its forward first: the previous step is read back while that forward runs, then
the masks are filled (``structured.py``, on threads) and the step samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.sample.columns import ONE_BY_ONE, SamplingTable
from worker.engine.sample.prompt_logprobs import PendingPrompt
from worker.engine.sample.sampler import PendingSample
from worker.engine.sched.schedule_output import SchedulerOutput


@dataclass
class InflightStep:
    """A launched step: what it computes and its sampled tokens, still on the device."""

    sched: SchedulerOutput
    sample: PendingSample
    # request id -> its row in ``sample.tokens``: made when first asked (``row_of``), as
    # most steps never ask (a dict of 256 ids cost ~0.05 ms a step)
    given_row_of: dict[str, int] | None = None
    prompt: PendingPrompt | None = None  # its prompt logprobs, on their way back
    # False: read back at once (no overlap), it advances with its tokens (advance_resolve)
    advanced: bool = True
    table: SamplingTable | None = None  # its sampling rows' constants (sampling_table.py)

    def one_by_one(self) -> bool:
        """Whether a sampling row's tokens go into the batch one at a time (a grammar,
        prompt logprobs): from the rows' constants of the launch, else the requests."""
        if self.table is not None:
            return self.table.any(ONE_BY_ONE)
        return any(r.grammar is not None or r.prompt_logprobs is not None
                   for r in self.sched.sampling)

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> its row in ``sample.tokens`` (the step's sampling rows, in order)."""
        if self.given_row_of is None:
            self.given_row_of = {r.request_id: i for i, r in enumerate(self.sched.sampling)}
        return self.given_row_of


def needs_known_tokens(sched: SchedulerOutput) -> bool:
    """Whether a sampling row of this step reads its request's earlier tokens on the host
    (a grammar, a multi-token bad word): the step before is read back before it samples
    (after its forward is launched)."""
    for item in sched.scheduled:
        if item.sample and (item.request.grammar is not None
                            or item.request.bans_follow_output):
            return True
    return False


def without_finished(sched: SchedulerOutput) -> SchedulerOutput:
    """The step less the requests that finished while it waited (their blocks are freed)."""
    kept = [item for item in sched.scheduled if not item.request.is_finished]
    return SchedulerOutput(kept, sum(item.num_new_tokens for item in kept), sched.preempted)
