"""The job table when a worker's output process makes the events (``FERRY_OUTPUT_PROCESS``).

The engine loop keeps what the engine needs — admission, cancels, deadlines, slots, the
held entries — and hands the rest to the output process (``output_proc/service.py``): each
admitted job (``JOB``), every step's ``StepBatch``, and how a request it stopped ended
(``END`` with its terminal reason, ``DROP`` without events). A request leaves the table
here when its last candidate ends in the engine (the batch's ``EngineEnd``s), which is
also when its slot is freed; its terminal event is the output process's. What comes
back is applied between steps: stop strings (``Engine.finish_stream``, a step late; the
output process ended the request already), entries no longer held, leases lost,
finished requests' stats. A dead output process is ``OutputDied`` on the next poll or
send: the worker exits ``EXIT_OUTPUT_DIED`` and its requests resume from the replay log
like after any crash.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import time
from collections import Counter
from typing import Any

from protocol.models import FinishReason
from worker.engine import EngineEnd, StepBatch, StreamOpen
from worker.service.active_job import ActiveJob
from worker.service.job_table import JobTable
from worker.service.jobs import Command, Outgoing
from worker.service.output_proc import link as m
from worker.service.output_proc.link import OutputDied, OutputLink


class RemoteJobTable(JobTable):
    def __init__(self, *args: Any, link: OutputLink, mailbox: queue.Queue[Any],
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.link = link
        self.link.on_message = self._on_message
        self.mailbox = mailbox
        self._request_of: dict[int, str] = {}  # open stream -> its public request id
        self._open: dict[str, int] = {}  # request id -> its candidates open in the engine
        self._abort_after: list[str] = []  # a candidate of these failed: stop the others

    # -- what comes back ---------------------------------------------------------------
    def poll(self) -> None:
        """Apply what the output process sent since; raises ``OutputDied``."""
        for stream, stop_str in self.link.poll():
            end = self.engine.finish_stream(stream, "stop", stop_str)
            if end is not None:  # the output process ended it already: only ours to count
                self._track([], [end])

    @property
    def outbox_depth(self) -> int:
        """The output process's outbox depth, as it last reported it (``STATS``)."""
        return int(self.link.stats.get("outbox_depth", 0))

    def _on_message(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == m.DISCARD:
            self.held.discard((message[1][0], message[1][1]))
        elif kind == m.LOST:
            self.mailbox.put(Command("lost", message[1]))
        elif kind == m.FINISHED:
            self.book.record(*message[1])
        elif kind == m.GAPS:
            self.metrics.add_inter_token(message[1], message[2])

    # -- the step ----------------------------------------------------------------------
    def step(self) -> StepBatch:
        self.poll()
        started = time.time() if self.trace.on else 0.0
        batch = self.engine.step()
        if started:
            self._trace(batch, started)
        if self._adapter_of and self.lora_metrics is not None:
            self._count_adapter_tokens(batch)
        self._track(batch.opened, batch.ends)
        self.link.send(batch)
        for request_id in self._abort_after:
            ends = self.engine.abort(request_id)
            opened = self.engine.streams.take_opened()
            self._track(opened, ends)
            self.link.send_ends(opened, ends)
        self._abort_after.clear()
        return batch

    def _count_adapter_tokens(self, batch: StepBatch) -> None:
        """Per-adapter token counts (multi-LoRA), from the rows: the text is elsewhere."""
        assert self.lora_metrics is not None
        new = {o.stream: o.request_id for o in batch.opened}
        rows = Counter(self._request_of.get(s) or new.get(s) for s in batch.streams)
        for request_id, n in rows.items():
            adapter = self._adapter_of.get(request_id or "")
            if adapter is not None:
                self.lora_metrics.tokens.labels(adapter=adapter).inc(n)

    def _trace(self, batch: StepBatch, started: float) -> None:
        """The step's first schedules and first tokens, for ``request_timeline``."""
        new = {o.stream: o.request_id for o in batch.opened}

        def rid(stream: int) -> str:
            return self._request_of.get(stream) or new.get(stream) or ""

        self.trace.step({rid(s): n for s, n in batch.cached.items()},
                        {rid(s) for s in batch.streams}, started, time.time())

    def events(self, outputs: Any, now: float) -> tuple[list[Outgoing], int]:
        return [], len(outputs)  # the output process makes them

    def _track(self, opened: list[StreamOpen], ends: list[EngineEnd], forget: bool = True
               ) -> None:
        """Count each request's candidates open in the engine; forget a request (free its
        slot) when the last one ends. One that failed stops its siblings (as in-process)."""
        for o in opened:
            self._request_of[o.stream] = o.request_id
            self._open[o.request_id] = self._open.get(o.request_id, 0) + 1
        for end in ends:
            request_id = self._request_of.pop(end.stream, None)
            if request_id is None:
                continue
            left = self._open.pop(request_id) - 1
            if left > 0:
                self._open[request_id] = left
                job = self.jobs.get(request_id)
                if job is not None and job.multi and end.finish_reason not in ("stop", "length"):
                    self._abort_after.append(request_id)
            elif forget:
                self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.trace.forget(request_id)
        if self.jobs.pop(request_id, None) is not None:
            self.deadlines.pop(request_id, None)
            self._adapter_of.pop(request_id, None)
            self.slots.release()

    # -- the table's hooks -------------------------------------------------------------
    def _admitted(self, job: ActiveJob) -> None:
        self.link.send_message([m.JOB, pickle.dumps(job)])

    def _close(self, job: ActiveJob, reason: FinishReason, error: str) -> None:
        rid = job.request_id
        ends = self.engine.abort(rid)
        opened = self.engine.streams.take_opened()
        self._track(opened, ends)
        self._forget(rid)
        self.link.send_message([m.END, rid, reason, error, m.pack_opened(opened),
                                [m.pack_end(e) for e in ends]])

    def _drop(self, request_id: str) -> None:
        ends = self.engine.abort(request_id)
        opened = self.engine.streams.take_opened()
        self._track(opened, ends, forget=False)
        self.link.send_message([m.DROP, request_id, m.pack_opened(opened),
                                [m.pack_end(e) for e in ends]])

    def abort_all(self) -> int:
        with contextlib.suppress(OutputDied):  # shutdown after it died: nothing to tell
            return super().abort_all()
        count = len(self.jobs)
        self.jobs.clear()
        return count

    def close(self, timeout_s: float) -> None:
        """Shutdown: the output process writes what it has, then every entry it settled
        is discarded here (before the rest are handed back)."""
        self.link.close(timeout_s)
