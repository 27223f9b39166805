"""Where a request's time to first token went, on this worker: one debug log line per
request (``request_timeline``) at its first token.

The parts, all wall-clock seconds on this machine (the producer stamps ``created_at`` on
the same clock when it runs here, as the benchmarks do):

* ``queue_s``: from the request's creation to the intake's pull (the wait in the fair
  backlog), with how it was routed (``affinity``: offered to this worker; ``stolen``:
  offered to another and taken here after the steal time; ``unmarked``; ``reclaimed``:
  taken over from a dead or stalled worker) and ``mark_wait_s``, the fair pull's own
  count from the mark to the pull;
* ``start_s``: from the pull to the engine loop's admission, in two parts:
  ``prepare_s`` (starting the job in Redis and tokenizing its prompt) and ``mailbox_s``
  (waiting for the engine loop to finish its current step and take it);
* ``engine_wait_s``: from the admission to the start of the step that first scheduled it
  (the engine's waiting queue);
* ``prefill_s``: from that step's start to the end of the step that gave its first token.

Off unless the worker logs at debug level (``FERRY_LOG_LEVEL=debug``): then the engine
loop keeps the jobs awaiting a first token and looks up each step's rows against them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

LOGGER = "ferry.worker.ttft"
log = structlog.get_logger(LOGGER)


@dataclass(slots=True)
class Trace:
    """What the intake and the engine loop stamp on one request on its way to a first
    token (wall-clock seconds)."""

    pulled_at: float = 0.0  # the intake took it
    route: str = "reclaimed"  # see the module docstring
    mark_wait_s: float | None = None  # mark -> pull, counted by the fair pull (marked only)
    prepared_at: float | None = None  # its prompt tokenized, posted to the engine loop
    scheduled_at: float | None = None  # start of the step that first scheduled it
    cached: int | None = None  # prompt tokens the prefix cache served it


class Traced(Protocol):
    """What ``StepTrace`` reads of a job (``active_job.ActiveJob``)."""

    request_id: str
    started_at: float  # admitted by the engine loop
    trace: Trace

    @property
    def request(self) -> Any: ...


class StepTrace:
    """The engine loop's side: jobs admitted and awaiting a first token, stamped by
    each step's rows; logs each one's ``request_timeline`` at its first token."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.on = logging.getLogger(LOGGER).isEnabledFor(logging.DEBUG)
        self._waiting: dict[str, Traced] = {}

    def admitted(self, job: Traced) -> None:
        if self.on:
            self._waiting[job.request_id] = job

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def step(self, scheduled: Mapping[str, int] | None, produced: Iterable[str],
             started: float, ended: float) -> None:
        """One step from ``started`` to ``ended`` (wall clock): the requests it scheduled
        for the first time, with their prompt tokens served from the cache (None: not
        known; the first-token step is then taken as the first scheduled), and those it
        gave a token to."""
        if not self._waiting:
            return
        for rid, cached in (scheduled or {}).items():
            job = self._waiting.get(rid)
            if job is not None and job.trace.scheduled_at is None:
                job.trace.scheduled_at, job.trace.cached = started, cached
        for rid in produced:
            job = self._waiting.pop(rid, None)
            if job is not None:
                self._log(job, started, ended)

    def _log(self, job: Traced, started: float, ended: float) -> None:
        t = job.trace
        created = job.request.created_at
        scheduled = t.scheduled_at if t.scheduled_at is not None else started
        prepared = t.prepared_at if t.prepared_at is not None else job.started_at
        log.debug("request_timeline", request_id=job.request_id, worker=self.worker_id,
                  route=t.route, mark_wait_s=t.mark_wait_s,
                  queue_s=round(t.pulled_at - created, 4),
                  start_s=round(job.started_at - t.pulled_at, 4),
                  prepare_s=round(prepared - t.pulled_at, 4),
                  mailbox_s=round(job.started_at - prepared, 4),
                  engine_wait_s=round(scheduled - job.started_at, 4),
                  prefill_s=round(ended - scheduled, 4),
                  ttft_s=round(ended - created, 4), cached=t.cached,
                  scheduled_at=round(scheduled, 4), first_token_at=round(ended, 4))
