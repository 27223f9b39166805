"""Slots: how many stream entries the intake may take now, so bursts spread over workers.

The intake takes an entry only while the batch has room and few entries wait to start
(``prefetch``): a burst then spreads over every idle worker instead of queueing behind
the first one's prefills. The high-priority lane ignores the batch-room bound (but not
the prefetch bound): its requests preempt lower-priority work on a full worker.
"""

from __future__ import annotations

import threading


class Slots:
    """Places the intake may fill: the intake takes, the engine loop gives back.

    ``held`` counts every request this worker owns (on its way, waiting, running);
    ``held - running`` of them have not started. The intake may take an entry while the
    batch has room (``held < total``) and fewer than ``prefetch`` wait to start.
    """

    def __init__(self, total: int, prefetch: int) -> None:
        self.total = total
        self.prefetch = prefetch
        self._held = 0
        self.running = 0
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        return self._held

    def free(self) -> int:
        return min(self.total - self._held, self.prefetch - (self._held - self.running))

    def free_urgent(self) -> int:
        """Room for the high-priority lane: only the prefetch bound applies, so a worker
        whose batch is full still takes urgent work (the scheduler preempts for it)."""
        return self.prefetch - (self._held - self.running)

    def wait_free(self, timeout: float) -> int:
        with self._cond:
            if self.free() <= 0:
                self._cond.wait(timeout)
            return self.free()

    def set_running(self, running: int) -> None:
        """The engine loop, after a step that changed how many requests are in the running
        batch (it reads ``running`` to know)."""
        with self._cond:
            self.running = running
            self._cond.notify_all()

    def take(self, n: int = 1) -> None:
        with self._cond:
            self._held += n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._held = max(0, self._held - n)
            self._cond.notify_all()
