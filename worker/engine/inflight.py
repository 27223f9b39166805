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

from worker.engine.sample.prompt_logprobs import PendingPrompt
from worker.engine.sample.rows import RowConstants
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
    constants: RowConstants | None = None  # its sampling rows' constants (sample/rows.py)

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> its row in ``sample.tokens`` (the step's sampling rows, in order)."""
        if self.given_row_of is None:
            self.given_row_of = {r.request_id: i for i, r in enumerate(self.sched.sampling)}
        return self.given_row_of
