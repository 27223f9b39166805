"""The output process in the worker service (``FERRY_OUTPUT_PROCESS``): text, the requests'
events and their fenced writes to Redis, off the engine's GIL.

The engine process (``remote_table.RemoteJobTable``) keeps admission, cancels, deadlines,
slots and the held entries; it sends each admitted request's ``ActiveJob`` (``JOB``),
every step's ``StepBatch``, and how a request it stopped ended (``END``, ``DROP``). Here
``StreamTexts`` turns the batches into text (a stop string goes back as ``STOP``: the
engine ends the request a step late, its extra token never published), ``JobEvents``
(the code the in-process path runs) builds the events, and an ``Outbox`` of its own
writes them with the same fenced-push script, so leases, fencing and the replay log are
exactly today's (on a Redis Cluster it pushes per master: ``cluster_push.py``, parking a
failing-over master's events, as in-process). What the outbox learns goes back:
``DISCARD`` (an entry no longer held), ``LOST`` (the fence refused: stop the request),
``FINISHED`` (stats, fair ledger), ``GAPS`` (inter-token latencies, binned per pass) and
``STATS`` (the outbox's depth, for the heartbeat).
"""

from __future__ import annotations

import functools
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.engine import EngineEnd, StreamTexts
from worker.service.active_job import ActiveJob
from worker.service.job_events import JobEvents
from worker.service.jobs import Command, Outgoing
from worker.service.metrics.prometheus import GapBins
from worker.service.metrics.stats import finished_fields
from worker.service.outbox.thread import Outbox
from worker.service.output_proc import link as m
from worker.service.redis.connection import LazyClusterClient

Send = Callable[[list[Any]], None]
_DEPTH_EVERY_S = 0.2


class _HeldProxy:
    """The outbox's ``HeldEntries``: the engine process holds them; tell it.

    Whether a request is still held (a cluster pusher forgets what it sent for the others)
    is answered here as the engine process's leases would answer it: from admission until
    the outbox settles its terminal event. Ending a request here (its terminal event built)
    is not enough: a failover can park that event, and the pusher must still have the
    events it sent to refill a replay log the failover cut short."""

    def __init__(self, send: Send, open_jobs: Any) -> None:
        self._send = send
        self._open = open_jobs  # request id -> job: not ended in this process
        self._ending: dict[tuple[str, str], str] = {}  # entry -> request id, final unsettled
        self._ending_ids: set[str] = set()

    def ending(self, entry: tuple[str, str], request_id: str) -> None:
        self._ending[(entry[0], entry[1])] = request_id
        self._ending_ids.add(request_id)

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._open or request_id in self._ending_ids

    def discard(self, entry: tuple[str, str]) -> None:
        request_id = self._ending.pop((entry[0], entry[1]), None)
        if request_id is not None:
            self._ending_ids.discard(request_id)
        self._send([m.DISCARD, list(entry)])


class _MailboxProxy:
    """The outbox's mailbox to the engine loop: a refused event stops its request."""

    def __init__(self, send: Send) -> None:
        self._send = send

    def put(self, command: Command) -> None:
        self._send([m.LOST, command.request_id])


class ServiceOutputs:
    def __init__(self, options: dict[str, Any], tokenizer: Any, send: Send) -> None:
        settings = pickle.loads(options["settings"])  # noqa: S301 - our own engine process
        self._send = send
        self.stops: list[list[Any]] = []
        self.texts = StreamTexts(tokenizer, self._on_stop)
        token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: str(tokenizer.decode([token])))
        self.gaps = GapBins()
        # a failed candidate's siblings end here as the engine's abort ends them in-process
        # (the engine process aborts them right after the batch; their ends then find
        # nothing open here), so the terminal event lists them the same way
        self.ev = JobEvents(token_text, self._on_end, self.texts.abort, self.gaps)
        self.held = _HeldProxy(send, self.ev.jobs)
        self.outbox = Outbox(settings, self.held, _MailboxProxy(send))  # type: ignore[arg-type]
        if isinstance(self.outbox.redis, LazyClusterClient):
            self.outbox.redis.warm()  # knows every node while the URL's answers
        self.outbox.start()
        self._depth_sent = (0, 0.0)  # the outbox depth last reported, and when
        self.alive: Callable[[], None] = lambda: None  # answers the engine's pings (serve)

    def _still_alive(self) -> bool:
        """The outbox is full (Redis away): waiting for room is being alive, not hung, so
        the engine's pings are answered meanwhile; never give the events up."""
        self.alive()
        return False

    def _on_stop(self, stream: int, stop_str: str) -> EngineEnd | None:
        self.stops.append([m.STOP, stream, stop_str])
        return None  # the engine hears of it with the next message: this stream ends here

    def _on_end(self, job: ActiveJob, item: Outgoing | None) -> None:
        if item is not None and item.final:  # held until the outbox settles it (_HeldProxy)
            self.held.ending(job.entry, job.request_id)
        fields = finished_fields(job, item) if item is not None else None
        if fields is not None:
            self._send([m.FINISHED, fields])

    def handle(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == m.BATCH:
            outputs = self.texts.apply(m.unpack_batch(message))
            items, _ = self.ev.events(outputs, time.monotonic())
            self.outbox.put(items, self._still_alive)
        elif kind == m.JOB:
            admitted: ActiveJob = pickle.loads(message[1])  # noqa: S301 - our engine process
            self.ev.jobs[admitted.request_id] = admitted
        elif kind == m.END:  # [END, request id, reason, error, opened, ends]
            _, request_id, reason, error, opened, ends = message
            outs = self._ends(opened, ends)
            job = self.ev.jobs.get(request_id)
            if job is not None:  # else it ended here already (a stop string)
                out = self.ev.closing_output(job, outs)
                self.outbox.put([self.ev.end(job, reason, out, error)], self._still_alive)
        elif kind == m.DROP:  # [DROP, request id, opened, ends]
            self._ends(message[2], message[3])
            self.ev.jobs.pop(message[1], None)

    def _ends(self, opened: list[Any], ends: list[Any]) -> list[Any]:
        self.texts.open(m.unpack_opened(opened))
        return self.texts.ends([m.unpack_end(e) for e in ends])

    def flush_stops(self) -> None:
        """After each pass: the stop strings found, and the inter-token gaps binned."""
        for stop in self.stops:
            self._send(stop)
        self.stops.clear()
        gaps = self.gaps.take()
        if gaps is not None:
            self._send([m.GAPS, *gaps])
        self._report_depth()

    def _report_depth(self) -> None:
        """The outbox's depth for the engine process's heartbeat, when it changed (at most
        every ``_DEPTH_EVERY_S``: the heartbeat is written once a second)."""
        depth, now = self.outbox.depth, time.monotonic()
        if depth != self._depth_sent[0] and now - self._depth_sent[1] >= _DEPTH_EVERY_S:
            self._depth_sent = (depth, now)
            self._send([m.STATS, {"outbox_depth": depth}, None])

    def close(self, timeout_s: float) -> None:
        """Write what is pending (up to ``timeout_s``), then stop the outbox."""
        self.outbox.close(timeout=timeout_s)


def serve(options: dict[str, Any], tokenizer: Any, inbox: Any, send: Send) -> int:
    """The service mode's loop: every message in order, the stop strings after each pass,
    the engine's latest ping answered after each message (and while the outbox is full);
    at ``QUIT`` (a clean shutdown) the outbox drains; when the engine process is gone
    (end of file) only briefly, since its entries are handed on by the lease anyway."""
    _log_like_the_worker(options)
    outputs = ServiceOutputs(options, tokenizer, send)
    outputs.alive = functools.partial(inbox.answer, send)
    while True:
        for message in inbox.take(0.5):
            if message is None or message[0] == m.QUIT:
                outputs.flush_stops()
                outputs.close(10.0 if message is not None else 2.0)
                return 0
            outputs.handle(message)
            outputs.alive()
        outputs.flush_stops()
        outputs.alive()


def _log_like_the_worker(options: dict[str, Any]) -> None:
    """The worker's log format (JSON in containers or with ``FERRY_LOG_JSON``) and level,
    each line naming the worker, so its outbox's warnings read like the engine process's."""
    import structlog

    from observability.logging import configure_logging

    configure_logging(level=options.get("log_level", "info"))
    settings = pickle.loads(options["settings"])  # noqa: S301 - our own engine process
    structlog.contextvars.bind_contextvars(worker_id=settings.worker_id, process="output")


def locked(send: Send) -> Send:
    """``send`` from several threads (the outbox thread reports too)."""
    lock = threading.Lock()

    def locked_send(message: list[Any]) -> None:
        with lock:
            send(message)

    return locked_send
