"""Overlapped steps: step N+1 is scheduled and launched before step N is read back.

On a GPU the host's share of a step (scheduling, building inputs, detokenizing, stop
checks) would otherwise leave the device idle between steps. With ``async_scheduling``
the engine launches a step and returns to the host work while it runs: the scheduler
counts each sampling row's token at launch (a placeholder, ``request.py``), the next
step is scheduled from those counts, and a decode whose input is a placeholder reads it
from the previous step's sampled tokens on the device (``ModelRunner`` patches them in),
so no step waits for the previous one's read-back. A request that ends at step N (EOS,
stop string, cancel) may already be in step N+1: that token is computed and dropped.

Steps whose sampling needs earlier tokens' values on the host (a grammar's mask,
repetition/presence/frequency penalties, a multi-token bad word) read the previous step
back first.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.sampler import PendingSample
from worker.engine.scheduler import SchedulerOutput


@dataclass
class InflightStep:
    """A launched step: what it computes and its sampled tokens, still on the device."""

    sched: SchedulerOutput
    sample: PendingSample
    row_of: dict[str, int]  # request id -> its row in ``sample.tokens``


def needs_known_tokens(sched: SchedulerOutput) -> bool:
    """Whether a sampling row of this step reads its request's earlier tokens on the host."""
    for item in sched.scheduled:
        if not item.sample:
            continue
        p = item.request.params
        if item.request.grammar is not None or p.repetition_penalty != 1.0 \
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
                or item.request.bans_follow_output:
            return True
    return False


def without_finished(sched: SchedulerOutput) -> SchedulerOutput:
    """The step less the requests that finished while it waited (their blocks are freed)."""
    kept = [item for item in sched.scheduled if not item.request.is_finished]
    return SchedulerOutput(kept, sum(item.num_new_tokens for item in kept), sched.preempted)
